"""Checkpoints of the block-wise pipeline: what a finished block leaves on disk, and resuming from it.

A checkpoint directory holds, after block ``k - 1`` finished:

* ``block_0000.pt`` ... ``block_{k-1}.pt``: each finished block's masks, re-fitted and dense weights, reports;
* ``inputs_<key>_{k}.pt`` (one per token set: ``fit``, ``holdout``, and with block tuning the dense model's
  ``fit_dense``, ``holdout_dense``): the inputs of block ``k``;
* ``progress.json``: the marker. It names the files above (and only those count), records the sha256 of each
  (``hashes``) and of the job's cached measurements beside them (``measurements``: ``dense.json``, the dense
  perplexity), and the :class:`Fingerprint` of the run: per-part hashes of everything that changes the output (model
  config and weights, dtype, calibration and held-out windows, options) plus the options themselves.

Block ``k`` is recorded by writing ``block_{k}.pt`` and ``inputs_<key>_{k+1}.pt`` under new names, then atomically
replacing ``progress.json`` (the commit point), then deleting block ``k``'s inputs. A crash anywhere in between
leaves either the old marker with its files intact or the new one with its files intact; files that no marker
names (an interrupted write, ``*.tmp``) are removed on the next start. A restart with a different model, dtype,
calibration data or options, or with other numerics (:func:`numerics`: batch size, device, torch and transformers
versions, CPU threads), stops with a :class:`CheckpointMismatch` naming what differs.

**Integrity** (issue 47). A resume trusts nothing the marker does not vouch for: every file name it holds must be a
name this module writes, inside the directory (no absolute or ``../`` path, no symbolic link leading out), and
every file it reads must have the sha256 the marker recorded when it was committed; a file that cannot be loaded
(e.g. a planted pickle, which ``weights_only=True`` refuses) is named as such. Each case is a
:class:`CheckpointCorrupt` (a ``ValueError``: one line from the CLI) naming the file and how to start over. The hashes
catch corruption and edits of the files; they are no defence against someone who rewrites the marker as well. A
checkpoint of the previous format (no hashes) is refused as written by an older version.

The out-of-core path (:func:`~sparseswaps_prune.llm.streaming.prune_checkpoint`) records its blocks with the same
layout and protocol (:func:`commit_block`); its block files hold the layer reports only, since the block's pruned
weights are already in its output shards. Its fingerprint hashes the source's files where the in-memory one hashes
the loaded parameters, so a restart in the other mode is named as such (``--blockwise``), not as another model
(:func:`check_mode` checks it from the marker alone, before a model is loaded).

**Ranks** (``torch.distributed``, a directory every rank sees). Every rank holds the same weights after a block but
only its own calibration windows (``calib_shards``), so each writes its own inputs, ``inputs_<key>_r<rank>_{k+1}.pt``,
and rank 0 the block file; once every rank has sent it the sha256 of its files, rank 0 commits the marker, which
names (and hashes) every rank's files, and removes the old ones; a barrier lets no rank run ahead of the commit. A
rank killed anywhere fails the run on every rank (their next collective call errors; a stopped rank, at the collective
timeout), and a restart with the same number of ranks resumes from the last committed block on every rank; the number
of ranks is part of the fingerprint. On a resume each rank checks the files it reads; one that fails tells the others.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.atomic import save_json, save_torch
from sparseswaps_prune.llm.capture import BlockInputs

logger = logging.getLogger(__name__)

FORMAT = 3  # 3: content hashes of every file (issue 47); 2: per-part fingerprints
PROGRESS = "progress.json"
MEASUREMENTS = ("dense.json",)  # the job's cached measurements beside the checkpoint; the marker records their hashes
STREAMS = ("fit", "holdout")  # the pipeline's token sets: calibration and held-out windows


def dense_key(key: str) -> str:
    """The key of the dense model's inputs beside the pruned model's ``key`` (``"fit"`` -> ``"fit_dense"``), carried
    with block tuning."""
    return f"{key}_dense"


INPUT_KEYS = STREAMS + tuple(dense_key(key) for key in STREAMS)  # every key a checkpoint may hold inputs under
# Every name this module writes (and the temporary files of their atomic writes); nothing else in the directory
# (e.g. the job's dense.json) is ever removed.
_OWN_FILE = re.compile(r"^(block_\d+\.pt|inputs_\w+\.pt|\.(block_|inputs_|progress\.json).*\.tmp)$")
_BLOCK_FILE, _INPUT_FILE = re.compile(r"block_\d{4,}\.pt"), re.compile(r"inputs_\w+\.pt")
# Settings only the block-wise path's fingerprint records (``io.fingerprints.blockwise_fingerprint``): a checkpoint
# holding them was made by ``prune_checkpoint`` (``--blockwise``), one without them by ``prune_model`` (in memory). The
# two hash the weights differently (the source's files; the loaded parameters), so their model parts cannot be compared.
BLOCKWISE_SETTINGS = ("max_shard_size", "output_plan")
# Config entries that do not change the computation (paths, versions, the dtype: a part of its own).
_CONFIG_IGNORED = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}


class CheckpointMismatch(ValueError):
    """The checkpoint in a directory belongs to another run (its message says which part differs)."""


class CheckpointCorrupt(CheckpointMismatch):
    """A checkpoint cannot be trusted: a file differs from the hash its marker recorded, cannot be loaded, or the
    marker names a path outside the checkpoint's directory (the message names the file and how to start over)."""


def _start_over(state: Path) -> str:
    return f"to start over, delete {state} or use a new output directory (--out)"


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def to_plain(obj: Any) -> Any:
    """JSON-ready form of an options object: dataclasses (nested ones included; each gets its class name under
    ``"type"``), mappings, tuples/lists/sets, enums, paths, dtypes and JSON scalars; anything else as ``repr``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"type": type(obj).__name__, **fields}
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_plain(v) for v in obj), key=repr)
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value)
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (Path, torch.dtype, torch.device)):
        return str(obj)
    return repr(obj)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out |= _flatten(value, f"{prefix}.{key}" if prefix else key)
        return out
    return {prefix: obj}


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def tokens_digest(tokens: torch.Tensor | None) -> str:
    """Hash of a token tensor (its shape and int64 values); ``"none"`` for None."""
    if tokens is None:
        return "none"
    h = hashlib.sha256(str(tuple(tokens.shape)).encode())
    h.update(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def numerics(batch_size: int, device: torch.device | str) -> dict[str, Any]:
    """What besides the model, the options and the windows changes a run's bits, so that a resume must keep it
    (settings of :func:`fingerprint`): ``batch_size`` (the windows per forward: matrix kernels round by the
    batch's shape), ``device`` (``"cpu"``, or a CUDA device by name), the versions of ``torch`` and
    ``transformers`` (the model's forward) and on the CPU ``cpu_threads`` (``torch.get_num_threads()``: LAPACK's
    Cholesky factors, which every re-fit solves with, round differently on one thread and on two)."""
    import transformers

    device = torch.device(device)
    name = f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    found = {
        "batch_size": batch_size,
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return found | ({"cpu_threads": torch.get_num_threads()} if device.type == "cpu" else {})


def config_digest(model: nn.Module) -> str:
    """Hash of the model's class and config without paths, versions and dtype (the ``model_config`` part); reads
    no weights, so it works on a model whose parameters are on ``meta``."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config_data = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_IGNORED}
    else:
        config_data = {}
    return _digest({"class": type(model).__name__, "config": to_plain(config_data)})


def model_parts(model: nn.Module) -> dict[str, str]:
    """What identifies a model's computation: ``model_config`` (hash of its config without paths, versions and
    dtype; the class name without a config), ``model_weights`` (sha256 over every parameter's and buffer's name,
    dtype, shape and bytes: about 1 s per GB) and ``dtype`` (the parameters' dtypes, e.g. ``"float32"``)."""
    h = hashlib.sha256()
    dtypes = set()
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, tensor in named:
            if kind == "p":
                dtypes.add(str(tensor.dtype).removeprefix("torch."))
            h.update(f"{kind}:{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            h.update(_tensor_bytes(tensor))
    return {
        "model_config": config_digest(model),
        "model_weights": h.hexdigest()[:16],
        "dtype": ",".join(sorted(dtypes)) or "none",
    }


@dataclass
class Fingerprint:
    """Per-part hashes of everything that changes a run's output (``parts``), its options as plain JSON, and the
    values of its other settings (``settings``, e.g. ``keep_dense``), so that a mismatch can say what changed.

    Parts (see :func:`fingerprint`): ``model_config``, ``model_weights``, ``dtype``, ``options``, ``calibration``,
    ``holdout`` and one per setting."""

    parts: dict[str, str]
    options: Any = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"parts": dict(self.parts), "options": self.options, "settings": dict(self.settings)}

    @classmethod
    def from_dict(cls, data: Any) -> Fingerprint | None:
        """The fingerprint :meth:`to_dict` wrote; None for anything else (e.g. an older single-hash format)."""
        if not isinstance(data, dict) or not isinstance(data.get("parts"), dict):
            return None
        return cls(dict(data["parts"]), data.get("options"), dict(data.get("settings") or {}))

    @property
    def blockwise(self) -> bool:
        """Whether this is the fingerprint of a block-wise run (``prune_checkpoint``, ``--blockwise``)."""
        return any(key in self.parts for key in BLOCKWISE_SETTINGS)

    def differences(self, other: Fingerprint) -> list[str]:
        """What differs from ``other`` (the new run), in words, e.g. ``["another model (weights differ)"]``."""
        a, b = self.parts, other.parts
        changed = {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}
        out = []
        if self.blockwise != other.blockwise:
            # The two paths hash the model differently: name the mode, not a model that did not change.
            out.append(_mode_change(self.blockwise, other.blockwise))
            changed -= {"model_config", "model_weights", *BLOCKWISE_SETTINGS}
        if "dtype" in changed:
            out.append(f"another dtype ({a.get('dtype')} -> {b.get('dtype')})")
            changed.discard("model_weights")  # a cast changes every weight's bytes
        model = [what for what, key in (("config", "model_config"), ("weights", "model_weights")) if key in changed]
        if model:
            out.append(f"another model ({'/'.join(model)} differ{'s' if model == ['config'] else ''})")
        if "options" in changed:
            old, new = _flatten(self.options or {}), _flatten(other.options or {})
            diffs = [f"{k} {old.get(k, '(none)')} -> {new.get(k, '(none)')}" for k in sorted(old.keys() | new.keys())
                     if old.get(k) != new.get(k)]  # fmt: skip
            out.append(f"other options: {'; '.join(diffs) or 'they differ'}")
        for key in ("calibration", "holdout"):
            if key in changed:
                out.append(f"other {key} windows")
        settings = sorted(changed - {"dtype", "model_config", "model_weights", "options", "calibration", "holdout"})
        if settings:
            diffs = [f"{k} {self.settings.get(k, '(none)')} -> {other.settings.get(k, '(none)')}" for k in settings]
            out.append(f"other settings: {'; '.join(diffs)}")
        return out


def _mode_change(saved: bool, current: bool) -> str:
    """A run's mode changed between a crash and its re-run, in words (``saved``, ``current``: blockwise)."""
    mode = {True: "blockwise=True: block by block (--blockwise)", False: "blockwise=False: in memory"}
    return (
        f"another mode ({mode[saved]} -> {mode[current]}; to resume, re-run {'with' if saved else 'without'} "
        "--blockwise as before)"
    )


def fingerprint(
    model: nn.Module,
    options: Any,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None = None,
    *,
    known_model_parts: dict[str, str] | None = None,
    **settings: Any,
) -> Fingerprint:
    """The :class:`Fingerprint` of pruning the (still dense) ``model`` with ``options`` (any options object:
    serialised by :func:`to_plain`) on ``calib_tokens`` / ``holdout_tokens``. ``known_model_parts`` (what
    :func:`model_parts` returned for this model) saves hashing the weights again; each ``settings`` entry (e.g.
    ``keep_dense=True``) becomes a part of its own."""
    plain = to_plain(options)
    parts = (known_model_parts or model_parts(model)) | {
        "options": _digest(plain),
        "calibration": tokens_digest(calib_tokens),
        "holdout": tokens_digest(holdout_tokens),
    }
    plain_settings = {key: to_plain(value) for key, value in settings.items()}
    parts |= {key: _digest(value) for key, value in plain_settings.items()}
    return Fingerprint(parts, plain, plain_settings)


def mismatch_message(state: Path, saved: Fingerprint | None, current: Fingerprint) -> str | None:
    """None if ``saved`` equals ``current``, else the error message naming what differs and how to start over."""
    if saved is not None and saved.parts == current.parts:
        return None
    if saved is None:
        what = "was written by an older version (it records no per-part fingerprint)"
    else:
        what = f"was made with {' and '.join(saved.differences(current)) or 'another run'}"
    return f"the checkpoint in {state} {what}; {_start_over(state)}"


def _format_message(state: Path, progress: dict[str, Any]) -> str | None:
    """None if ``progress`` is of this version's :data:`FORMAT`, else why it is refused (older or newer)."""
    found = progress.get("format")
    if found == FORMAT:
        return None
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT:
        return f"the checkpoint in {state} was written by a newer version (format {found}); {_start_over(state)}"
    why = "its files carry no content hashes" if found == 2 else "it records no per-part fingerprint"
    return f"the checkpoint in {state} was written by an older version ({why}); {_start_over(state)}"


def _read_progress(state: Path) -> dict[str, Any] | None:
    path = state / PROGRESS
    if not path.exists():
        return None
    try:
        progress = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointCorrupt(f"{path} is unreadable ({err}); {_start_over(state)}") from None
    return progress if isinstance(progress, dict) else {}


def check(state: str | Path, current: Fingerprint) -> bool:
    """Raise :class:`CheckpointMismatch` if ``state`` holds a checkpoint of another run; True if it holds one
    of this run, False if none."""
    state = Path(state)
    progress = _read_progress(state)
    if progress is None:
        return False
    message = _format_message(state, progress)
    if message is None:
        message = mismatch_message(state, Fingerprint.from_dict(progress.get("fingerprint")), current)
    if message is not None:
        raise CheckpointMismatch(message)
    return True


def check_mode(state: str | Path, blockwise: bool) -> None:
    """Raise :class:`CheckpointMismatch` naming ``--blockwise`` if ``state`` holds a checkpoint made in the other
    mode (block-wise or in memory; :attr:`Fingerprint.blockwise`). Reads only the marker, so a run can check this
    before it loads the model; every other part is compared by :func:`check` once it is known."""
    state = Path(state)
    progress = _read_progress(state)
    if progress is None or progress.get("format") != FORMAT:
        return
    saved = Fingerprint.from_dict(progress.get("fingerprint"))
    if saved is not None and saved.blockwise != blockwise:
        raise CheckpointMismatch(
            f"the checkpoint in {state} was made with {_mode_change(saved.blockwise, blockwise)}; to start over, "
            f"delete {state} or use a new output directory (--out)"
        )


def _named_files(progress: dict[str, Any] | None) -> set[str]:
    if progress is None:
        return set()
    return set(progress.get("blocks", [])) | set(progress.get("inputs", {}).values())


def _confined(state: Path, name: Any, pattern: re.Pattern[str], what: str) -> Path:
    """``state / name`` for a ``name`` from the marker that is a plain file name of this module's (``pattern``) and
    stays inside ``state`` once resolved (no absolute or ``../`` path, no symbolic link leading out).

    Raises:
        CheckpointCorrupt: naming the path."""
    path = state / name if isinstance(name, str) else None
    if (
        path is None
        or not pattern.fullmatch(name)
        or Path(name).name != name
        or path.resolve().parent != state.resolve()
    ):
        raise CheckpointCorrupt(
            f"the checkpoint in {state} names {name!r} as {what}, which is not a file of its own directory (an "
            f"absolute or ../ path, a link leading out, or another name); refused: {_start_over(state)}"
        )
    return path


def _validated(state: Path, progress: dict[str, Any]) -> dict[str, Any]:
    """``progress`` (a marker of this :data:`FORMAT`) checked for shape and confinement: ``next_block`` an int >= 1,
    ``blocks`` the names ``block_0000.pt`` ... of the finished blocks, ``inputs`` slot -> input file name, ``hashes``
    a sha256 for every named file; every name inside ``state`` (:func:`_confined`).

    Raises:
        CheckpointCorrupt: naming what is wrong."""
    next_block, blocks = progress.get("next_block"), progress.get("blocks")
    inputs, hashes = progress.get("inputs"), progress.get("hashes")
    malformed = (
        isinstance(next_block, bool)
        or not isinstance(next_block, int)
        or next_block < 1
        or not isinstance(blocks, list)
        or not isinstance(inputs, dict)
        or not isinstance(hashes, dict)
        or not isinstance(progress.get("measurements", {}), dict)
    )
    if malformed:
        raise CheckpointCorrupt(f"{state / PROGRESS} is malformed; {_start_over(state)}")
    for name in blocks:
        _confined(state, name, _BLOCK_FILE, "a block file")
    for name in inputs.values():
        _confined(state, name, _INPUT_FILE, "an inputs file")
    if blocks != [f"block_{i:04d}.pt" for i in range(next_block)]:
        raise CheckpointCorrupt(
            f"{state / PROGRESS} is inconsistent (its blocks {blocks[:3]}... do not match next_block {next_block}); "
            f"{_start_over(state)}"
        )
    unhashed = sorted(name for name in _named_files(progress) if not isinstance(hashes.get(name), str))
    if unhashed:
        raise CheckpointCorrupt(f"{state / PROGRESS} records no hash of {', '.join(unhashed)}; {_start_over(state)}")
    return progress


def _verify(path: Path, expected: str, state: Path) -> None:
    """Raise :class:`CheckpointCorrupt` naming ``path`` if its sha256 is not ``expected``."""
    if file_digest(path) != expected:
        raise CheckpointCorrupt(_altered(path, state))


def _altered(path: Path, state: Path) -> str:
    return (
        f"{path} differs from the file that was committed (its sha256 is not the one {PROGRESS} records: "
        f"corrupted or altered); the checkpoint cannot be trusted: {_start_over(state)}"
    )


def _unloadable(path: Path, err: BaseException, state: Path) -> CheckpointCorrupt:
    """The error for a checkpoint file that ``torch.load`` refuses (a planted pickle, a truncated file, ...)."""
    reason = " ".join(str(err).split())[:200] or type(err).__name__
    return CheckpointCorrupt(f"{path} cannot be loaded ({type(err).__name__}: {reason}); {_start_over(state)}")


def recorded_hash(state: str | Path, name: str) -> str | None:
    """The sha256 the committed marker in ``state`` records for the measurement file ``name`` (one of
    :data:`MEASUREMENTS`, e.g. the job's ``dense.json``), or None (no marker, another format, not recorded)."""
    state = Path(state)
    try:
        progress = _read_progress(state)
    except CheckpointMismatch:
        return None
    if progress is None or progress.get("format") != FORMAT or not isinstance(progress.get("measurements"), dict):
        return None
    found = progress["measurements"].get(name)
    return found if isinstance(found, str) else None


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def remove_strays(state: Path, progress: dict[str, Any] | None) -> None:
    """Delete this module's files in ``state`` that ``progress`` does not name (left by an interrupted write)."""
    keep = _named_files(progress) | {PROGRESS}
    if not state.is_dir():
        return
    for path in sorted(state.iterdir()):
        if path.name not in keep and _OWN_FILE.match(path.name) and path.is_file():
            logger.debug("removing %s (not part of the checkpoint)", path)
            _remove(path)


def _input_slot(key: str, rank: int | None) -> str:
    """The marker's name for a token set's inputs: ``key`` in one process (``rank`` None), ``key.rank<r>``."""
    return key if rank is None else f"{key}.rank{rank}"


def _input_file(key: str, block: int, rank: int | None) -> str:
    """The file of a token set's inputs to ``block``: ``inputs_<key>_<block>.pt``, ``inputs_<key>_r<rank>_...``."""
    return f"inputs_{key}_{block:04d}.pt" if rank is None else f"inputs_{key}_r{rank}_{block:04d}.pt"


@dataclass
class Resumed:
    """A checkpoint to continue from: the next block's index and inputs; :meth:`blocks` yields the finished
    blocks' payloads (``masks``, ``warmstart``, ``weights``, ``dense``: name -> tensor; ``reports``: dicts)."""

    state: Path
    next_block: int
    inputs: dict[str, BlockInputs]
    block_files: list[str]
    hashes: dict[str, str] = dataclasses.field(default_factory=dict)

    def blocks(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, payload)`` of every finished block, loaded one at a time, each checked against the sha256 the
        marker records (read once: hashed, then loaded from memory).

        Raises:
            CheckpointCorrupt: a block file differs from its hash or cannot be loaded."""
        for index, name in enumerate(self.block_files):
            path = self.state / name
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != self.hashes.get(name):
                raise CheckpointCorrupt(_altered(path, self.state))
            try:
                payload = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as err:
                raise _unloadable(path, err, self.state) from err
            del data
            yield index, payload


def load(state: str | Path, current: Fingerprint, ranks: Any = None) -> Resumed | None:
    """The checkpoint in ``state`` to continue from, or None if there is none (files of an interrupted first
    block are removed). With ``ranks`` (:class:`~sparseswaps_prune.llm.distributed.Ranks`), this rank's inputs.
    Raises :class:`CheckpointMismatch` if it belongs to another run, or is incomplete."""
    state = Path(state)
    if not check(state, current):
        remove_strays(state, None)
        return None
    progress = _validated(state, _read_progress(state))
    names = _named_files(progress)
    missing = sorted(name for name in names if not (state / name).is_file())
    if missing:
        raise CheckpointMismatch(
            f"the checkpoint in {state} is incomplete ({', '.join(missing)} missing); {_start_over(state)}"
        )
    next_block, hashes = progress["next_block"], progress["hashes"]
    own = {_input_slot(key, None if ranks is None else ranks.rank): key for key in INPUT_KEYS}
    inputs, error = {}, None
    try:  # this rank's inputs; a rank that fails tells the others, so that every rank stops, none waits
        for slot, name in sorted(progress["inputs"].items()):
            if slot in own:
                _verify(state / name, hashes[name], state)
                try:
                    inputs[own[slot]] = BlockInputs.load(state / name)
                except Exception as err:
                    raise _unloadable(state / name, err, state) from err
    except CheckpointCorrupt as err:
        error = str(err)
    if ranks is not None and ranks.world_size > 1:
        errors = [ranks.broadcast(error, src=r) for r in range(ranks.world_size)]
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointCorrupt(error)
    remove_strays(state, progress)
    for key, part in inputs.items():
        if part.block_index != next_block:
            raise CheckpointMismatch(
                f"the checkpoint in {state} is inconsistent ({key} inputs feed block {part.block_index}, the marker "
                f"says block {next_block}); {_start_over(state)}"
            )
    logger.info("resuming at block %d from %s", next_block, state)
    return Resumed(state, next_block, inputs, list(progress["blocks"]), dict(hashes))


def save_block(
    state: str | Path,
    current: Fingerprint,
    index: int,
    inputs: dict[str, BlockInputs],
    layers: list[Any],
    result: Any,
    reports: list[Any],
    ranks: Any = None,
) -> None:
    """Record block ``index`` of :func:`~sparseswaps_prune.llm.pipeline.prune_model` as finished: its masks (and
    re-fitted and dense weights, and reports, from the pipeline's ``result``) and the next block's ``inputs``
    (:func:`commit_block`)."""
    names = [layer.name for layer in layers]
    tune = next((t for t in result.block_tunes if t.block == index), None)  # tuned weights are always recorded
    by_name = {layer.name: layer for layer in layers}
    main = ranks is None or ranks.is_main
    payload = None
    if main:
        payload = {
            "masks": {n: result.masks[n] for n in names},
            "warmstart": {n: result.warmstart_masks[n] for n in names},
            "weights": {
                r.name: by_name[r.name].dense_weight_2d().cpu()
                for r in reports
                if r.updated_rows is not None or tune is not None
            },
            "dense": {n: result.dense_weights[n] for n in names if n in result.dense_weights},
        } | reports_payload(reports, tune)
    commit_block(state, current, index, inputs, payload, ranks)


def reports_payload(reports: list[Any], tune: Any = None) -> dict[str, Any]:
    """The reports part of a block file, as plain dicts: the block's layer reports (``LayerReport``) and its block
    tuning report (``BlockTuneReport``; None: the block was not tuned). ``pipeline.saved_reports`` reads it back."""
    return {"reports": [asdict(r) for r in reports], "tune": None if tune is None else asdict(tune)}


def commit_block(
    state: str | Path,
    current: Fingerprint,
    index: int,
    inputs: dict[str, BlockInputs],
    payload: dict[str, Any] | None,
    ranks: Any = None,
) -> None:
    """Record block ``index`` as finished: ``payload`` (what resuming needs of the block, e.g. its reports; rank 0's
    is written to ``block_{index}.pt``, other ranks pass None), the next block's ``inputs``, then the progress marker
    (the commit point), then delete what the previous marker named and this one does not. Whatever else the block
    left on disk must be durable before this is called. The marker records the sha256 of every file it names (those
    of earlier blocks carried over from the previous marker) and of the :data:`MEASUREMENTS` present. With ``ranks``
    (:class:`~sparseswaps_prune.llm.distributed.Ranks`) every rank calls this: each writes and hashes its own
    inputs and sends the hashes to rank 0, which writes the block and the marker (see the module docstring)."""
    state = Path(state)
    main = ranks is None or ranks.is_main
    block_file = f"block_{index:04d}.pt"
    rank = None if ranks is None else ranks.rank
    every_rank = [None] if ranks is None else range(ranks.world_size)
    all_inputs = {_input_slot(key, r): _input_file(key, index + 1, r) for key in sorted(inputs) for r in every_rank}
    own_files = {key: _input_file(key, index + 1, rank) for key in sorted(inputs)}
    progress = {
        "format": FORMAT,
        "fingerprint": current.to_dict(),
        "next_block": index + 1,
        "blocks": [f"block_{i:04d}.pt" for i in range(index + 1)],
        "inputs": all_inputs,
    }
    try:
        if main:
            save_torch(payload, state / block_file)
        for key, part in sorted(inputs.items()):
            part.save(state / own_files[key])
        hashes = {name: file_digest(state / name) for name in own_files.values()}
        if ranks is not None:  # every rank's files are written once rank 0 has received every rank's hashes
            for r in range(ranks.world_size):
                hashes |= ranks.broadcast(hashes if r == rank else None, src=r) or {}
        if main:
            hashes[block_file] = file_digest(state / block_file)
            progress["hashes"] = _earlier_hashes(state, progress["blocks"][:-1]) | hashes
            progress["measurements"] = {
                name: file_digest(state / name) for name in MEASUREMENTS if (state / name).is_file()
            }
            save_json(progress, state / PROGRESS)
    except Exception:
        # e.g. a full disk: free what this uncommitted block wrote (no marker names it). An interrupt leaves it,
        # as a kill would; the next start removes it.
        for name in ([block_file] if main else []) + list(own_files.values()):
            _remove(state / name)
        raise
    if main:
        remove_strays(state, progress)
    if ranks is not None:
        ranks.barrier()  # no rank runs ahead of the commit


def _earlier_hashes(state: Path, names: list[str]) -> dict[str, str]:
    """The hashes of the block files ``names`` (earlier blocks): those the committed marker records, else (never
    in a run of this version) their files' own."""
    previous = _read_progress(state) or {}
    recorded = previous.get("hashes") if isinstance(previous.get("hashes"), dict) else {}
    return {name: recorded[name] if isinstance(recorded.get(name), str) else file_digest(state / name)
            for name in names}  # fmt: skip


def remove_checkpoint(state: str | Path) -> None:
    """Delete the checkpoint in ``state`` once its run has finished: the progress marker first (so that an
    interrupted removal leaves no checkpoint to resume), then this module's other files, then ``state`` itself if
    nothing else is left in it. Files this module did not write are kept."""
    state = Path(state)
    _remove(state / PROGRESS)
    remove_strays(state, None)
    try:
        state.rmdir()
    except OSError:
        pass  # missing, or it holds other files
