"""`report_to`: a training run's metrics and evaluations sent to TensorBoard and/or Weights & Biases,
besides the run directory's JSONL files.

This module owns the reporters: which package each needs (an optional extra, imported only when
listed), the start-up check that it is installed, the numeric scalars taken from a record, and the
W&B offline default. TensorBoard event files go to RUN_DIR/tensorboard/ (tensorboardX's SummaryWriter,
or PyTorch's with the `tensorboard` package); W&B runs are named after the run directory and keep
their files in it. The run loop (commands/train.py) creates one `Reporters` on rank 0.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from mlx_grpo.base.errors import UserError
from mlx_grpo.config.run import REPORTERS

# the extra that installs each report_to value's package (the values: config/run.REPORTERS; a test keeps both in step)
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
# record fields that are the step itself, not a curve
_STEP_KEYS = frozenset({"update_step", "batch_step"})


def _install_hint(name: str) -> str:
    return f"pip install 'mlx-grpo[{EXTRAS[name]}]' (or bash scripts/setup.sh {EXTRAS[name]})"


def _has(module: str) -> bool:
    if module in sys.modules:  # already imported (or blocked: None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(names: list[str]) -> None:
    """Raise a UserError naming the extra to install for the first listed reporter whose package is
    missing; cheap (nothing is imported), so the run can check before it loads anything."""
    for name in names:
        if name not in REPORTERS:
            raise UserError(f"report_to: unknown reporter {name!r}; choose from {', '.join(REPORTERS)}")
        if name == "tensorboard" and not (_has("tensorboardX") or (_has("torch") and _has("tensorboard"))):
            raise UserError(f"report_to = tensorboard needs tensorboardX: {_install_hint(name)}")
        if name == "wandb" and not _has("wandb"):
            raise UserError(f"report_to = wandb needs the wandb package: {_install_hint(name)}")


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric scalar fields of a record (booleans as 0/1), keyed `prefix + key`; None, strings, lists
    and dicts (e.g. `warnings`) are left out, as are the step counters."""
    out = {}
    for key, value in record.items():
        if key in _STEP_KEYS or not isinstance(value, (int, float)):
            continue
        out[prefix + key] = float(value)
    return out


def wandb_logged_in() -> bool:
    """Whether W&B has credentials: WANDB_API_KEY, or a `wandb login` entry in the netrc file (where the
    wandb client stores it) for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _TensorBoard:
    def __init__(self, run_dir: Path, purge_step: int | None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError(f"report_to = tensorboard needs tensorboardX: {_install_hint('tensorboard')}") \
                    from None
        self.logdir = run_dir / "tensorboard"
        # purge_step: after a resume, TensorBoard hides the old events from the redone updates on
        self.writer = SummaryWriter(str(self.logdir), purge_step=purge_step)

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise UserError(f"report_to = wandb needs the wandb package: {_install_hint('wandb')}") from None
        mode = None  # WANDB_MODE, when set, is wandb's to read
        if not os.environ.get("WANDB_MODE") and not wandb_logged_in():
            mode = "offline"
            print(f"[mlx-grpo] wandb: no API key or login found, logging offline to {run_dir / 'wandb'} "
                  "(upload it later with `wandb sync`; `wandb login` or WANDB_MODE=online to log live)", flush=True)
        kwargs = {"project": os.environ.get("WANDB_PROJECT") or "mlx-grpo", "name": run_dir.name,
                  "dir": str(run_dir), "config": config}
        if mode is not None:
            kwargs["mode"] = mode
        self.run = wandb.init(**kwargs)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Reporters:
    """The reporters named in `report_to` (empty: none, every call a no-op). `log` takes one metrics
    record per update, `log_eval` one eval record (its fields under `eval/`), both at the update step."""

    def __init__(self, names: list[str], run_dir: str | Path, config: dict, *, resumed_at: int | None = None):
        """resumed_at: the update a resumed run continues after (its later events are superseded)."""
        check_installed(names)
        run_dir = Path(run_dir)
        self.names = list(names)
        self._backends: list = []
        try:
            for name in self.names:
                if name == "tensorboard":
                    self._backends.append(_TensorBoard(run_dir, None if resumed_at is None else resumed_at + 1))
                else:
                    self._backends.append(_WandB(run_dir, config))
        except BaseException:
            self.close(failed=True)
            raise

    def _each(self, call) -> None:
        """Call every reporter; one that fails (a full disk, a W&B outage) is dropped with one line: the
        metrics.jsonl record is written already and training goes on."""
        for backend in list(self._backends):
            try:
                call(backend)
            except Exception as exc:
                self._backends.remove(backend)
                print(f"[mlx-grpo] warning: report_to {type(backend).__name__.strip('_').lower()} stopped "
                      f"({type(exc).__name__}: {exc}); metrics.jsonl has every record", flush=True)

    def log(self, record: dict, step: int) -> None:
        values = scalars(record)
        self._each(lambda backend: backend.log(values, step))

    def log_eval(self, record: dict, step: int) -> None:
        values = scalars(record, "eval/")
        self._each(lambda backend: backend.log(values, step))

    def close(self, failed: bool = False) -> None:
        """Flush and close every reporter (failed: the run stopped on an error); safe to call twice."""
        self._each(lambda backend: backend.close(failed))
        self._backends = []
