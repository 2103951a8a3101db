"""Ready-made models and data sets so a training run needs no code of its own.

``models`` builds networks by name and ``datasets`` loads data already on disk (or bundled
with scikit-learn, or generated); nothing here downloads anything.
"""

from __future__ import annotations
