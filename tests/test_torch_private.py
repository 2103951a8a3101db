"""One test per private torch API in ddpkit._torch: each fails loudly on a torch that changed it."""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest
import torch

import ddpkit
import workers
from ddpkit import _torch
from workers import bucket_layout
from workers import three_layers as _three_layers


def _one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    return dist


def test_default_store_is_the_groups_store(tmp_path):
    _one_process_group(tmp_path)
    store = _torch.default_store()
    store.set("ddpkit/test", "yes")
    assert store.get("ddpkit/test") == b"yes"


def test_settle_ddp_buckets_runs_on_this_torch(tmp_path):
    _one_process_group(tmp_path)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)))
    _torch.settle_ddp_buckets(model)  # raises PrivateApiChanged if torch renamed them
    model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_ready_order_ddp_settles_the_last_layers_into_the_first_bucket(tmp_path):
    _one_process_group(tmp_path)
    model = _torch.ready_order_ddp(_three_layers())
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    _torch.settle_ddp_buckets(model)
    first, second = bucket_layout(model)
    assert first == second  # settled: DDP does not re-bucket after a backward
    assert len(first) == 2 and "0.weight" not in first[0] and "4.weight" in first[0], first
    assert first[1] == ["0.bias", "0.weight"]  # the first layer's gradients, ready last, go last


def test_settled_in_registration_order_the_first_layer_would_go_first(tmp_path):
    """What the test above guards against: the old settling (plain DDP) puts 0.weight in bucket 0."""
    _one_process_group(tmp_path)
    model = torch.nn.parallel.DistributedDataParallel(_three_layers())
    _torch.settle_ddp_buckets(model)
    assert "0.weight" in bucket_layout(model, steps=1)[0][0]


def test_ready_order_is_loud_when_torch_builds_the_list_elsewhere(tmp_path, monkeypatch):
    _one_process_group(tmp_path)
    monkeypatch.delattr(_torch._ReadyOrderDDP, "_build_params_for_reducer")  # as if torch renamed it
    model = _torch.ready_order_ddp(_three_layers())
    with pytest.raises(_torch.PrivateApiChanged, match="_build_params_for_reducer"):
        _torch.settle_ddp_buckets(model)


def test_settle_ddp_buckets_is_loud_when_the_api_is_gone():
    class NoReducer:
        reducer = object()

    with pytest.raises(_torch.PrivateApiChanged, match="_rebuild_buckets"):
        _torch.settle_ddp_buckets(NoReducer())


def test_missing_bucket_api_warns_and_marks_checkpoints_not_bitwise(tmp_path, monkeypatch):
    def changed(model):
        raise _torch.PrivateApiChanged("DistributedDataParallel.reducer._rebuild_buckets")

    from ddpkit.parallel.ddp import settle_buckets

    monkeypatch.setattr(_torch, "settle_ddp_buckets", changed)
    rt = ddpkit.init()
    with pytest.warns(UserWarning, match="rounding"):
        rt._run.loop.not_bitwise = settle_buckets(object(), is_main=True)
    path = rt.save(tmp_path / "c.pt", {}, blocking=True)
    assert "_rebuild_buckets" in ddpkit.checkpoint.read(path)["ddpkit"]["loop"]["not_bitwise"]
    with pytest.warns(UserWarning, match="not bitwise"):
        rt.load(path, {})


def test_scaler_found_inf_tells_a_skip_from_a_step():
    scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    assert _torch.scaler_found_inf(scaler, opt) is False
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(torch.tensor([[float("inf"), 1.0]])).sum()).backward()
    scaler.step(opt)
    assert _torch.scaler_found_inf(scaler, opt) is True


def test_scaler_found_inf_is_loud_when_the_api_is_gone():
    class OldScaler:
        pass

    with pytest.raises(_torch.PrivateApiChanged, match="_found_inf_per_device"):
        _torch.scaler_found_inf(OldScaler(), None)


def test_scaler_unscaled_is_true_from_unscale_to_update_and_loud_when_the_api_is_gone():
    scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Linear(2, 1)
    opt, other = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert _torch.scaler_unscaled(scaler, opt) is False
    scaler.unscale_(opt)
    assert _torch.scaler_unscaled(scaler, opt) is True
    assert _torch.scaler_unscaled(scaler, other) is False and id(other) not in scaler._per_optimizer_states
    scaler.step(opt)
    scaler.update()
    assert _torch.scaler_unscaled(scaler, opt) is False

    class OldScaler:
        pass

    with pytest.raises(_torch.PrivateApiChanged, match="_per_optimizer_states"):
        _torch.scaler_unscaled(OldScaler(), opt)


def test_unwrap_reaches_the_module_inside_compile_and_data_parallel():
    inner = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, as it imports dynamo
        wrapped = torch.compile(torch.nn.DataParallel(inner))  # torch.compile keeps it in _orig_mod
    assert _torch.unwrap(wrapped) is inner
    assert list(_torch.unwrap(wrapped).state_dict()) == ["weight", "bias"]  # plain names
    assert _torch.unwrap(inner) is inner and _torch.unwrap({"x": 1}) == {"x": 1}


class _Backbone(torch.nn.Module):
    """A module of the user's own whose child is named ``module``, beside a head: not a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(x))


def test_unwrap_leaves_a_users_child_named_module_and_names_wrappers_inside_a_users_module(tmp_path):
    """unwrap peeled any module with a ``module`` child: a checkpoint of it held the child alone (the
    head lost), ddpkit.evaluate ran the child alone. An EMA (AveragedModel) of the DDP model rt.setup
    returns names its entries module.module.* on 2 processes, module.* on one: plain_name drops the
    wrappers' own segments, so its checkpoint resumes on either."""
    from torch.optim.swa_utils import AveragedModel

    backbone = _Backbone()
    assert _torch.unwrap(backbone) is backbone and _torch.wrapper_segments(backbone) == []
    _one_process_group(tmp_path)
    ddp = torch.nn.parallel.DistributedDataParallel(_Backbone())
    assert _torch.unwrap(ddp) is ddp.module
    ema = AveragedModel(ddp)
    segments = _torch.wrapper_segments(ema)
    assert segments == ["module.module"]
    plain = [_torch.plain_name(key, segments) for key in ema.state_dict()]
    assert plain == list(AveragedModel(_Backbone()).state_dict())  # the names on one process
    assert plain == [
        "n_averaged",
        "module.module.weight",
        "module.module.bias",
        "module.head.weight",
        "module.head.bias",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = AveragedModel(torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 2))))
    segments = _torch.wrapper_segments(compiled)
    assert segments == ["module._orig_mod"]
    assert [_torch.plain_name(k, segments) for k in compiled.state_dict()][1:] == ["module.0.weight", "module.0.bias"]


def _dcp_checkpoint(path):
    """A DCP checkpoint written by this torch alone: a model of several dtypes, AdamW, plain values."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "plain": {"lr": 0.5, "name": "x"},
        "more": {"half": torch.ones(2, dtype=torch.bfloat16), "ids": torch.arange(3)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: dcp warns that it saves alone
        dcp.save(state, checkpoint_id=str(path))
    return state


def test_dcp_metadata_of_this_torch_is_made_of_the_allowlist_and_read_as_torch_reads_it(tmp_path):
    """ddpkit's reader unpickles ``.metadata`` with an allowlist: a global torch starts to use is named here."""
    from torch.distributed.checkpoint import FileSystemReader

    from ddpkit.checkpoint import dcp_reader

    _dcp_checkpoint(tmp_path)
    reader, theirs = dcp_reader.Reader(tmp_path), FileSystemReader(tmp_path)
    assert _torch.dcp_metadata_path(reader).name == ".metadata"
    assert _torch.dcp_metadata_path(reader, 1).name == "__1.metadata"
    ours, expected = reader.read_metadata(), theirs.read_metadata()  # raises UnsafeCheckpoint, naming it
    assert ours.state_dict_metadata == expected.state_dict_metadata
    assert ours.planner_data == expected.planner_data and ours.storage_data == expected.storage_data
    assert ours.storage_meta.load_id == reader.load_id and ours.storage_meta.save_id == expected.storage_meta.save_id
    assert reader.read_metadata() is ours  # read once per load
    reader.reset()
    again = reader.read_metadata()
    assert again is not ours and again.storage_meta.load_id == reader.load_id != ours.storage_meta.load_id
    reader.set_up_storage_reader(ours, True)
    index = next(iter(ours.storage_data))
    assert _torch.dcp_item_file(reader, index) == "__0_0.distcp"


def test_dcp_rebuilds_a_whole_checkpoint_in_one_process(tmp_path):
    from ddpkit.checkpoint import dcp_reader

    state = _dcp_checkpoint(tmp_path)
    assert isinstance(_torch.dcp_rebuilding_planner(), type)
    whole = dcp_reader.load_whole(tmp_path)  # dcp_rebuilding_planner + dcp_load_in_one_process
    assert whole["plain"] == {"lr": 0.5, "name": "x"} and whole["opt"]["param_groups"][0]["lr"] == 0.01
    for key, value in state["model"].items():
        assert torch.equal(whole["model"][key], value)
    assert whole["more"]["half"].dtype == torch.bfloat16 and torch.equal(whole["more"]["ids"], torch.arange(3))


def test_dcp_private_apis_are_loud_when_gone(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader, format_utils, state_dict_loader

    from ddpkit.checkpoint import dcp_reader

    reader = dcp_reader.Reader(tmp_path)
    with pytest.raises(_torch.PrivateApiChanged, match="_StorageInfo.relative_path"):
        _torch.dcp_item_file(reader, "no such item")
    monkeypatch.delattr(FileSystemReader, "_get_metadata_path")
    with pytest.raises(_torch.PrivateApiChanged, match="_get_metadata_path"):
        _torch.dcp_metadata_path(reader)
    monkeypatch.delattr(format_utils, "_EmptyStateDictLoadPlanner")
    with pytest.raises(_torch.PrivateApiChanged, match="_EmptyStateDictLoadPlanner"):
        _torch.dcp_rebuilding_planner()
    monkeypatch.delattr(state_dict_loader, "_load_state_dict")
    with pytest.raises(_torch.PrivateApiChanged, match="_load_state_dict"):
        _torch.dcp_load_in_one_process({}, reader, None)


class _Reports(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        with _torch.worker_info_hidden():
            hidden = torch.utils.data.get_worker_info()
        yield (info is not None and info.num_workers == 2, hidden is None, torch.utils.data.get_worker_info() is info)


def test_worker_info_hidden_hides_it_in_a_worker_and_restores_it():
    seen = list(torch.utils.data.DataLoader(_Reports(), batch_size=None, num_workers=2))
    assert [tuple(s) for s in seen] == [(True, True, True)] * 2


def test_worker_info_hidden_is_loud_when_the_api_is_gone(monkeypatch):
    from torch.utils.data._utils import worker

    monkeypatch.delattr(worker, "_worker_info")
    with pytest.raises(_torch.PrivateApiChanged, match="_worker_info"):
        with _torch.worker_info_hidden():
            pass


def test_use_env_rendezvous_makes_init_process_group_meet_through_the_given_handler(monkeypatch, tmp_path):
    import importlib

    import torch.distributed as dist

    module = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setitem(module._rendezvous_handlers, "env", module._rendezvous_handlers["env"])  # restored after
    used = []

    def handler(url, timeout=None, **kwargs):
        used.append(url)
        yield dist.FileStore(str(tmp_path / "store"), 1), 0, 1

    _torch.use_env_rendezvous(handler)
    dist.init_process_group("gloo")  # env:// with no MASTER_ADDR/PORT: only our handler can serve it
    try:
        assert used and used[0].startswith("env://") and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_use_env_rendezvous_is_loud_when_the_registry_is_gone(monkeypatch):
    import importlib

    monkeypatch.delattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers")
    with pytest.raises(_torch.PrivateApiChanged, match="_rendezvous_handlers"):
        _torch.use_env_rendezvous(lambda url, **kw: iter(()))


@pytest.mark.timeout(120)
def test_ddp_bucket_count_counts_the_reducers_buckets():
    counted, seen = ddpkit.launch(workers.ddpkit_bucket_count, nprocs=2)[0]
    assert counted == seen == 2  # DDP's 1 MiB first bucket, then the rest


def test_ddp_bucket_count_is_loud_when_the_api_is_gone(tmp_path, monkeypatch):
    _one_process_group(tmp_path)
    model = torch.nn.parallel.DistributedDataParallel(_three_layers())
    assert _torch.ddp_bucket_count(model) == 1  # a world of one: DDP keeps one bucket
    monkeypatch.setattr(torch.distributed.Reducer, "_get_zeros_like_grad_buckets", lambda self: [])
    with pytest.raises(_torch.PrivateApiChanged, match="no bucket listed"):
        _torch.ddp_bucket_count(model)
    monkeypatch.delattr(torch.distributed.Reducer, "_get_zeros_like_grad_buckets")
    with pytest.raises(_torch.PrivateApiChanged, match="_get_zeros_like_grad_buckets"):
        _torch.ddp_bucket_count(model)


def test_elastic_signal_exception_is_what_the_agent_raises_on_a_signal_and_carries_sigval():
    import signal

    from torch.distributed.elastic.multiprocessing import api

    cls = _torch.elastic_signal_exception()
    with pytest.raises(cls) as raised:
        api._terminate_process_handler(signal.SIGUSR1, None)  # the agent's own handler
    assert raised.value.sigval == signal.SIGUSR1
    import torch.distributed.run as torchrun

    args = torchrun.parse_args(["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "x.py"])  # what ddpkit run passes
    assert args.signals_to_handle == "SIGINT,SIGHUP,SIGQUIT"


# -- torchft ---------------------------------------------------------------------------------------
def test_every_torchft_seam_is_still_where_ddpkit_replaces_it():
    """Fails loudly when torchft renames a global ddpkit replaces, or stops calling it there."""
    pytest.importorskip("torchft")
    import importlib

    for key, (module, name, _) in _torch.TORCHFT_SEAMS.items():
        original = getattr(importlib.import_module(module), name)
        sentinel = object()
        previous = _torch.patch_torchft(**{key: sentinel})
        try:
            assert previous == {key: original} and getattr(importlib.import_module(module), name) is sentinel
        finally:
            _torch.patch_torchft(**previous)


def test_a_seam_torchft_no_longer_calls_raises(monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.setitem(
        _torch.TORCHFT_SEAMS, "ManagerServer", ("torchft.manager", "ManagerServer", "ManagerServer(bind_address=")
    )
    with pytest.raises(_torch.PrivateApiChanged, match="no longer calls 'ManagerServer"):
        _torch.patch_torchft(ManagerServer=object())


def test_torchft_managers_built_through_the_seam_listen_on_the_address_given_only():
    """torchft 0.2 binds [::]; through the seam, a Manager's server listens on the host ddpkit names."""
    pytest.importorskip("torchft")
    import datetime

    import psutil
    from torchft._torchft import LighthouseServer

    from ddpkit.distributed import ft

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    server = ft._bound_server("127.0.0.1")(
        replica_id="r",
        lighthouse_addr="http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[-1],
        hostname="127.0.0.1",
        bind="[::]:0",
        store_addr="127.0.0.1:1",
        world_size=1,
        heartbeat_interval=datetime.timedelta(seconds=1),
        connect_timeout=datetime.timedelta(seconds=5),
        quorum_retries=0,
    )
    try:
        port = int(server.address().rsplit(":", 1)[-1])
        mine = [
            c.laddr
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert mine and all(addr.ip == "127.0.0.1" for addr in mine), mine
    finally:
        server.shutdown()
        lighthouse.shutdown()


def test_the_collective_functions_live_in_distributed_c10d_with_group_and_tensor_parameters():
    from ddpkit.observe.collectives import OTHERS, SHAPED

    for op in SHAPED + OTHERS:
        found = _torch.distributed_functions(op)  # raises PrivateApiChanged if c10d lost it
        assert {module.__name__ for module, _ in found} == {"torch.distributed", "torch.distributed.distributed_c10d"}
        group, tensor = _torch.collective_parameters(found[0][1])
        assert group is not None, op  # every one takes a group: the log counts the default group's only
        if op in SHAPED:
            assert tensor is not None, op  # and those whose tensor must agree name it
    assert _torch.is_default_group(None)


@pytest.mark.timeout(120)
def test_the_default_groups_sequence_number_counts_each_call_on_it_and_none_of_another_group(tmp_path):
    """micro_shards refuses a shard whose body ran a collective of the script's by this count: an
    all_reduce, an all_gather, torch.distributed.nn's all_gather and a send or receive each add one; a
    call on a group of the script's own adds none. A group of one process has none to count."""
    runs = ddpkit.launch(workers.collective_sequences, nprocs=2)
    for seen in runs.values():
        assert [after - before for before, after in zip(seen, seen[1:])] == [1, 1, 1, 1, 0], seen
    gone = ddpkit.launch(workers.collective_sequences, nprocs=2, args=(True,))
    assert all("ProcessGroup._get_sequence_number_for_group" in said[0] for said in gone.values()), gone
    assert _torch.collective_sequence() is None  # no group
    _one_process_group(tmp_path)
    assert _torch.collective_sequence() is None


def test_a_torch_without_the_sequence_number_warns_once_and_the_shards_check_goes_off(monkeypatch):
    """Loud, not fatal: every micro-shard step would otherwise end in the exception's traceback."""
    from ddpkit.distributed import collectives

    def gone():
        raise _torch.PrivateApiChanged("torch.distributed.ProcessGroup._get_sequence_number_for_group")

    monkeypatch.setattr(_torch, "collective_sequence", gone)
    monkeypatch.setattr(collectives, "_COUNTED", [True])
    with pytest.warns(UserWarning, match=r"_get_sequence_number_for_group.*micro_shards no longer sees a collective"):
        assert collectives.script_collectives() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert collectives.script_collectives() is None  # said once
        with collectives.ddpkits_own():
            pass


def test_the_flight_recorder_dump_lists_this_processs_collectives(tmp_path, monkeypatch):
    name = _torch.flight_recorder_buffer_variable()  # raises PrivateApiChanged if torch lost both names
    assert name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    monkeypatch.setenv(name, "50")  # read when the group is made
    dist = _one_process_group(tmp_path)
    dist.all_reduce(torch.zeros(3))
    dump = _torch.flight_recorder_dump()
    entries = dump["entries"]
    if not entries:
        pytest.skip(f"torch {torch.__version__} records NCCL's collectives only (this is gloo)")
    last = entries[-1]
    assert last["profiling_name"].endswith("all_reduce") and last["input_sizes"] == [[3]]
    assert {"collective_seq_id", "state", "input_dtypes", "pg_id"} <= set(last)
    # the counters alone (the watchdog reads the entries only when they change): this group's, moving on
    before = _torch.flight_recorder_status()
    group = next(key for key in before if key.endswith("/" + str(last["pg_id"])))
    assert int(before[group]["last_enqueued_collective"]) == int(last["collective_seq_id"])
    assert int(before[group]["last_completed_collective"]) <= int(last["collective_seq_id"])
    dist.all_reduce(torch.zeros(3))
    after = _torch.flight_recorder_status()
    assert int(after[group]["last_enqueued_collective"]) == int(last["collective_seq_id"]) + 1


@pytest.mark.timeout(120)
def test_every_variable_the_elastic_agent_sets_for_a_worker_is_one_set_by_elastic_agent_names():
    """A forkserver child keeps only these of its own; one torch adds and ddpkit drops would fail here."""
    from ddpkit.distributed import stores
    from ddpkit.distributed.parent import launcher_env
    from ddpkit.distributed.torchrun import AGENT_ENV, flight_recorder_env

    ddpkits = {*launcher_env(), *AGENT_ENV, *stores.socket_env(1, "127.0.0.1", 0), *flight_recorder_env()}
    ddpkits |= {stores.STORE_DIR_ENV, "OMP_NUM_THREADS"}
    ddpkits |= {"COLUMNS", "LINES"}  # a terminal's size, in every spawned child of a pytest process
    before = dict(os.environ)
    child = ddpkit.launch(workers.environment, nprocs=2, start_method="spawn")[1]["environ"]
    from_agent = {key for key, value in child.items() if before.get(key) != value and key not in ddpkits}
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} <= from_agent
    assert {key for key in from_agent if not _torch.set_by_elastic_agent(key)} == set()
    assert not _torch.set_by_elastic_agent("DDPKIT_TEST_MARK") and not _torch.set_by_elastic_agent("PATH")


def test_version_of_counts_changes_in_place_shared_with_detach_and_views():
    weight = torch.nn.Parameter(torch.ones(3))
    seen = _torch.version_of(weight.detach())
    with torch.no_grad():
        weight[1:].mul_(2)  # through a view, without autograd: counted all the same
    assert _torch.version_of(weight.detach()) == _torch.version_of(weight) > seen
    weight.data.add_(1)  # .data has a counter of its own (the case a save cannot see)
    assert _torch.version_of(weight) == seen + 1


def test_version_of_is_loud_when_the_counter_is_gone():
    class NoCounter:
        pass

    with pytest.raises(_torch.PrivateApiChanged, match="torch.Tensor._version"):
        _torch.version_of(NoCounter())  # type: ignore[arg-type]


def test_module_buffers_is_the_dict_the_forward_reads():
    norm = torch.nn.BatchNorm1d(3)
    buffers = _torch.module_buffers(norm)
    assert set(buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    swapped = torch.full((3,), 5.0)
    buffers["running_mean"] = swapped
    assert norm.running_mean is swapped
    norm.eval()
    out = norm(torch.zeros(2, 3))
    assert torch.allclose(out, torch.full((2, 3), -5.0 / (1.0 + norm.eps) ** 0.5))


def test_scale_add_is_mul_then_add_for_each_pair_to_the_bit():
    g = torch.Generator().manual_seed(0)
    targets = [torch.randn(n, generator=g) for n in (3, 64, 1)]
    sources = [torch.randn(n, generator=g) * 1e-3 for n in (3, 64, 1)]
    want = [t.clone().mul_(0.9).add_(s, alpha=0.1) for t, s in zip(targets, sources)]
    _torch.scale_add_(targets, sources, 0.9, 0.1)
    assert all(torch.equal(t, w) for t, w in zip(targets, want))


def test_torchfts_manager_learns_its_groups_error_at_commit_and_ddpkit_reads_it_before():
    """torchft's NCCL group aborts a stalled collective in the background and records the error in
    ``_pg.errored()``; its Manager copies it only in ``should_commit``. ddpkit reads it earlier
    (``ft.Replica.failed`` on a GPU) through ``_torch.torchft_group_error``."""
    pytest.importorskip("torchft")
    import inspect

    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupNCCL

    assert "self._pg.errored()" in inspect.getsource(Manager.should_commit)
    assert callable(ProcessGroupNCCL.errored)

    class Group:
        def errored(self):
            return RuntimeError("aborted")

    class Holder:
        _pg = Group()

    assert str(_torch.torchft_group_error(Holder())) == "aborted"
    with pytest.raises(_torch.PrivateApiChanged, match="torchft.Manager._pg.errored"):
        _torch.torchft_group_error(object())


def test_the_reducer_says_a_backward_left_parameters_out_and_lists_its_parameters_last_first(tmp_path):
    """DDP's reducer check (_check_reducer_finalized) and its parameter list, which ddpkit's refusal of
    unused parameters reads; torch's message counts them by the reducer's indices."""
    from ddpkit.errors import UsageError
    from ddpkit.parallel.ddp import refuse_unused, unfinished_reduction

    _one_process_group(tmp_path)
    model = _torch.ready_order_ddp(workers._WithHead())
    assert _torch.reducer_parameter_names(model) == ["head.bias", "head.weight", "body.bias", "body.weight"]
    assert _torch.ddp_reduction_unfinished(model) is None  # no backward yet
    model(torch.randn(4, 8)).sum().backward()  # the head takes no part
    text = _torch.ddp_reduction_unfinished(model)
    assert text is not None and "Expected to have finished reduction" in text, text
    with pytest.raises(UsageError, match=r"got no gradient in this step \(head.weight, head.bias\)"):
        refuse_unused(model)
    with pytest.raises(RuntimeError) as raised:  # torch's own error at the next forward, the same condition
        model(torch.randn(4, 8))
    found = unfinished_reduction(raised.value)
    assert found is not None and "in the previous step (head.weight, head.bias)" in str(found), str(raised.value)
    assert unfinished_reduction(RuntimeError("another error")) is None
    assert _torch.reducer_parameter_names(torch.nn.Linear(2, 2)) is None


def test_without_the_reducers_check_the_step_warns_once_and_goes_on():
    from ddpkit.parallel.ddp import AcrossProcesses

    with pytest.raises(_torch.PrivateApiChanged, match="_check_reducer_finalized"):
        _torch.ddp_reduction_unfinished(object())
    mode = AcrossProcesses(types.SimpleNamespace(module=torch.nn.Linear(1, 1)))  # (no reducer of torch's)
    with pytest.warns(UserWarning, match="_check_reducer_finalized.*named at the next forward"):
        mode.complete([])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mode.complete([])  # once


TERMINATE = """
import ctypes, os, sys
import torch
from ddpkit import _torch

terminate = ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev  # what an exception no C++ frame caught calls
undo = _torch.on_cpp_terminate(lambda: print("handler ran", flush=True))
if sys.argv[1] == "undone":
    undo()
terminate()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch runs on libstdc++ on Linux")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["set", "undone"])
def test_on_cpp_terminate_runs_the_handler_then_the_c_runtimes_own_which_aborts(tmp_path, mode):
    import signal
    import subprocess

    script = tmp_path / "terminate.py"
    script.write_text(TERMINATE)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=50)
    assert done.returncode == -signal.SIGABRT  # it still ends as it would have
    assert ("handler ran" in done.stdout) == (mode == "set")
    assert "terminate called without an active exception" in done.stderr  # libstdc++'s own handler, after ours


def test_on_cpp_terminate_is_loud_where_no_c_runtime_has_it(monkeypatch):
    monkeypatch.setattr(_torch, "_TERMINATE_SYMBOL", "_ZSt13no_such_thingv")
    with pytest.raises(_torch.PrivateApiChanged, match="std::set_terminate"):
        _torch.on_cpp_terminate(lambda: None)


def test_load_pre_hook_runs_before_a_load_through_the_public_or_the_private_registration(monkeypatch):
    from ddpkit._torch import PrivateApiChanged, load_pre_hook

    seen = []
    module = torch.nn.Linear(2, 2)
    load_pre_hook(module, lambda mod, state, prefix, *rest: seen.append((mod, sorted(state), prefix)))
    module.load_state_dict(torch.nn.Linear(2, 2).state_dict())
    assert seen == [(module, ["bias", "weight"], "")]
    other = torch.nn.Linear(2, 2)  # torch 2.4: only the private registration, which the public one calls
    monkeypatch.delattr(torch.nn.Module, "register_load_state_dict_pre_hook", raising=False)
    load_pre_hook(other, lambda mod, state, prefix, *rest: seen.append((mod, sorted(state), prefix)))
    other.load_state_dict(module.state_dict())
    assert seen[-1] == (other, ["bias", "weight"], "")
    monkeypatch.delattr(torch.nn.Module, "_register_load_state_dict_pre_hook")
    with pytest.raises(PrivateApiChanged, match="_register_load_state_dict_pre_hook"):
        load_pre_hook(torch.nn.Linear(2, 2), lambda *args: None)


def test_dataloader_worker_pids_lists_a_passes_live_workers_and_is_loud_when_the_api_is_gone():
    dataloader_worker_pids = _torch.dataloader_worker_pids

    # (spawned: a fork of this many-threaded test process may hang in a worker)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    batches = iter(loader)
    next(batches)
    pids = dataloader_worker_pids(batches)
    assert len(pids) == 2 and all(isinstance(pid, int) and pid > 0 for pid in pids)
    del batches  # the pass's iterator gone: its workers end

    class Moved:  # a torch that keeps its workers elsewhere
        pass

    with pytest.raises(_torch.PrivateApiChanged, match="DataLoader iterator._workers"):
        dataloader_worker_pids(Moved())
