"""ddpkit's names in the kernel: the namespaces, veths and bridges of simulated hosts, and what runs there.

:mod:`ddpkit.bench.netsim` makes them; this module runs ``ip``/``tc`` with one-line errors
(:class:`NetsimError`), stops every process inside a namespace (SIGTERM, then SIGKILL after a
grace), deletes namespaces and links, and finds what is left: :func:`leftovers` lists the names
that exist now, and :func:`remove_leftovers` removes those whose owner (recorded in
``/run/ddpkit-netsim/<tag>``) is dead, as after a SIGKILLed ``ddpkit bench --hosts``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from ddpkit.errors import UsageError

_NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps its names (/var/run is /run)
_OWNERS = Path("/run/ddpkit-netsim")  # <tag>: "pid create_time" of the process that made them
_GRACE_S = 5.0
_NAMESPACE = re.compile(r"^ddpk-([A-Za-z0-9]+)-(?:h\d+|probe)$")
_VETH = re.compile(r"^dk([A-Za-z0-9]+)h\d+$")
_BRIDGE = re.compile(r"^dkbr([A-Za-z0-9]+)$")
_TAG = re.compile(r"^[A-Za-z0-9]{1,9}$")  # dk<tag>h253 must fit IFNAMSIZ (15 characters)


class NetsimError(UsageError):
    """Simulated hosts cannot be made or removed here; the message is one line."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetsimError(f"`{' '.join(cmd)}` failed: {_one_line(str(exc))}") from exc
    if done.returncode != 0:
        raise NetsimError(f"`{' '.join(cmd)}` failed: {_one_line(done.stderr) or f'exit {done.returncode}'}")
    return done.stdout


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise NetsimError(f"tag {tag!r} must be 1 to 9 letters or digits (it goes into interface names)")
    return tag


def _stop(procs: list[subprocess.Popen], namespaces: list[str]) -> list[str]:
    """SIGTERM, then SIGKILL after the grace, every process group of ``procs`` and all in ``namespaces``."""
    for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, _GRACE_S)):
        for proc in procs:
            if proc.poll() is None or _group_alive(proc.pid):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass  # the whole group ended meanwhile
        for pid in sum(_namespace_pids(namespaces).values(), []):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all(proc.poll() is not None for proc in procs) and not any(_namespace_pids(namespaces).values()):
                return []
            time.sleep(0.05)
    left = sorted(sum(_namespace_pids(namespaces).values(), []) + [p.pid for p in procs if p.poll() is None])
    return [f"processes {left} survived SIGKILL"] if left else []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _namespace_pids(namespaces: list[str]) -> dict[str, list[int]]:
    """Live (not zombie) processes in each namespace, as `ip netns pids` finds them, in one /proc scan."""
    ids = {}
    for name in namespaces:
        try:
            st = os.stat(_NETNS_DIR / name)
        except FileNotFoundError:
            continue
        ids[(st.st_dev, st.st_ino)] = name
    found: dict[str, list[int]] = {name: [] for name in ids.values()}
    if not ids:
        return found
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue  # gone, or a zombie: it holds no namespace
            if (name := ids.get((st.st_dev, st.st_ino))) is not None:
                found[name].append(int(entry))
    return found


def _delete(kind: str, name: str) -> str | None:
    """Delete a namespace or link; None when it is gone afterwards, else what failed."""
    cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", "dev", name]
    try:
        _run(cmd)
    except NetsimError as exc:
        if kind == "netns":
            gone = not (_NETNS_DIR / name).exists()
        else:
            gone = subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode != 0
        return None if gone else str(exc)
    return None


def _scan() -> list[tuple[str, str, str]]:
    """(kind, tag, name) of every namespace, veth and bridge that ddpkit's names match."""
    found = []
    for line in _run(["ip", "netns", "list"]).splitlines():
        if line.strip() and (match := _NAMESPACE.match(line.split()[0])):
            found.append(("netns", match.group(1), match.group(0)))
    for link in json.loads(_run(["ip", "-j", "-d", "link", "show"]) or "[]"):
        kind = link.get("linkinfo", {}).get("info_kind")
        pattern = {"bridge": _BRIDGE, "veth": _VETH}.get(kind)
        if pattern is not None and (match := pattern.match(link["ifname"])):
            found.append((kind, match.group(1), match.group(0)))
    return found


def leftovers(tag: str | None = None) -> dict[str, list[str]]:
    """Namespaces and links made by ddpkit that exist now: of every tag, or of ``tag`` only."""
    found = [(kind, name) for kind, t, name in _scan() if tag in (None, t)]
    return {
        "namespaces": sorted(name for kind, name in found if kind == "netns"),
        "links": sorted(name for kind, name in found if kind != "netns"),
    }


def _owner_alive(tag: str) -> bool:
    try:
        pid_text, created = (_OWNERS / tag).read_text().split()
        pid, create_time = int(pid_text), float(created)
    except (FileNotFoundError, ValueError):  # none, or not ours to read: judge by the tag
        if not tag.isdigit():
            return False  # owner files come first and go last: a dead run
        pid, create_time = int(tag), None
    import psutil  # (here: make gpu-check's image may lack it, and never simulates hosts)

    try:
        owner = psutil.Process(pid)
        return owner.status() != psutil.STATUS_ZOMBIE and (
            create_time is None or abs(owner.create_time() - create_time) < 0.01
        )
    except psutil.NoSuchProcess:
        return False


def remove_leftovers(tag: str | None = None) -> None:
    """Remove the names of ``tag``, or of every tag whose owner is dead, killing what runs inside.

    Raises :class:`NetsimError` naming what could not be removed.
    """
    if tag is not None:
        _check_tag(tag)
    found = _scan()
    owned = {path.name for path in _OWNERS.glob("*")} if _OWNERS.is_dir() else set()
    tags = {t for _, t, _ in found} | owned
    tags = {tag} if tag is not None else {t for t in tags if not _owner_alive(t)}
    found = [(kind, name) for kind, t, name in found if t in tags]
    errors = _stop([], [name for kind, name in found if kind == "netns"])
    # veths first (each takes its peer in the namespace along), then namespaces, then bridges
    for wanted in ("veth", "netns", "bridge"):
        for kind, name in found:
            if kind == wanted and (error := _delete("netns" if kind == "netns" else "link", name)):
                errors.append(error)
    if errors:
        raise NetsimError(f"leftover simulated hosts not removed: {'; '.join(errors)}")
    for t in tags:
        (_OWNERS / t).unlink(missing_ok=True)
