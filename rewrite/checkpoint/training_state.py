"""Resumable training state: model, optimizer, scheduler, RNG and the caller's own state, with DCP.

    ckpt/
      latest              names the newest complete checkpoint; written last, atomically
      step-00000040/      torch.distributed.checkpoint files (each rank wrote its own boxes)
      step-00000050/      config.json (+ tokenizer) so that `export` needs nothing else, and
                          model.json: the model the state was written for (`model_mark`);
                          lora.json under a LoRA plan: its settings and the frozen base's
                          fingerprint (the state holds the adapters and their moments only)

Tensors are stored as whole tensors cut into the boxes each rank held (`pieces`), so a checkpoint
loads under any other plan of the same model. A save killed half-way leaves `latest` naming the
previous checkpoint; the next save of that step starts over.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ..agreement import agree, raise_problems, share
from ..pipeline.stage import Stage
from ..values import is_count, is_int
from .finite import NonFiniteState, nonfinite_problems
from .lora_state import LORA_FILE, base_problem, base_sums, lora_record, state_kind_problems
from .model_mark import model_change, write_mark
from .pieces import PieceSavePlanner, fit_problems, fresh_optimizer_pieces, model_pieces, optimizer_pieces, plain_data_problems
from .safe_reader import load_pieces, read_metadata
from .state_dirs import LATEST, checkpoint_path, latest_checkpoint, point_latest, prune, saved_steps, step_dir
from ..errors import CheckpointError, CheckpointWriteError
from ..plan.wording import format_bytes
from .space import space_needs, space_problems, space_view

__all__ = ["save_training_state", "load_training_state", "latest_checkpoint", "saved_steps", "step_dir", "LATEST"]


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(directory: str | Path, stage: Stage, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                        extra: dict | None = None, *, step: int | None = None, keep: int | None = None,
                        tokenizer: Any = None) -> Path:
    """Write a complete, resumable checkpoint of this training run under `directory`.

    Collective. Each rank writes its boxes of the model's tensors and of the optimizer state
    (moments boxed like their parameters; replicated boxes once) and its RNG state; rank 0
    adds the scheduler, `extra`, the config and `tokenizer`, and only once every rank has
    finished points `directory/latest` at the new `step-N`, then deletes those beyond `keep`.

    Args:
        directory: the run's checkpoint directory, visible to every rank.
        stage: this rank's stage (`apply_plan` / `from_pretrained`).
        optimizer: its optimizer, over `stage.parameters()`.
        scheduler: an LR scheduler (anything with `state_dict`), or None.
        extra: the caller's own state (step, data position, ...), the same on every rank, returned by
            `load_training_state`: plain data only (dicts, lists, numbers, strings, None, tensors).
        step: names the checkpoint `step-N`; default `extra["step"]`, else one past the latest.
        keep: keep only this many newest checkpoints (None: keep all).
        tokenizer: saved beside the weights (`save_pretrained`), so that `export` finds it.

    Returns:
        The new checkpoint's path, `directory/step-N`.

    Raises:
        InputError (a ValueError): on every rank, before anything is written: a bad `step` or `keep`,
            the step already the latest, optimizer state that cannot be boxed, `extra` not plain data;
            `NonFiniteState` (an InputError) when parameters or optimizer state hold nan or inf.
        CheckpointWriteError (an OSError): on every rank: the checkpoint would not fit in the free
            space of its file system (counted first), or writing it failed (a full disk, an I/O error);
            what was written of it is removed, `latest` is untouched.

    Example:
        >>> rewrite.save_training_state("ckpt", stage, optimizer, scheduler, extra={"step": 50})
    """
    directory = Path(directory)
    problems, step, boxes, moments = _save_problems(directory, stage, optimizer, scheduler, extra, step, keep)
    what = f"save_training_state({str(directory)!r})"
    view = space_view(directory, {**boxes, **moments}) if not problems else None
    sums = base_sums(stage) if stage.resolved.plan.lora is not None and not problems else None
    gathered = share((problems, nonfinite_problems(stage, optimizer), view, sums))  # the first collective
    raise_problems([found for found, *_ in gathered], what)
    raise_problems([diverged for _, diverged, *_ in gathered], what, NonFiniteState)
    record = lora_record(stage, [s for *_, s in gathered]) if sums is not None else None
    needs = space_needs([v for _, _, v, _ in gathered])
    if too_big := space_problems(needs, directory):
        raise CheckpointWriteError(f"{what}: " + "; ".join(too_big))
    path = step_dir(directory, step)
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)  # a save of this step that died before `latest` named it
    dist.barrier()
    failed, interrupted = _write(_state(stage, optimizer, scheduler, extra, step, boxes, moments), path)
    if dist.get_rank() == 0:
        failed = failed or _finish(stage, directory, path, step, keep, tokenizer, record)
    failed = share(failed)[0]  # rank 0's word: no rank goes on before `latest` names this one, or all raise
    if interrupted:  # Ctrl-C during the write: the partial goes, the interrupt goes on
        _after_failure(directory, path)
        raise KeyboardInterrupt
    if failed is not None:
        need = format_bytes(max(n for n, _ in needs.values()))
        raise CheckpointWriteError(f"{what}: writing {path.name} (about {need}) failed: {failed}; "
                                   + _after_failure(directory, path))
    return path


def _save_problems(directory: Path, stage: Stage, optimizer, scheduler, extra, step, keep
                   ) -> tuple[list[str], Any, dict, dict]:
    """This rank's problems with the arguments and state, the step, and the model's and optimizer's boxes."""
    problems, boxes, moments = [], {}, {}
    try:
        latest = latest_checkpoint(directory)
        if step is None:
            step = extra.get("step") if isinstance(extra, dict) and is_int(extra.get("step")) else None
        if step is None:
            step = latest[0] + 1 if latest else 1
        if not is_count(step, 0):
            problems.append(f"step={step!r}: use a whole number >= 0 (it names the checkpoint step-N)")
        elif latest is not None and latest[0] == step:
            problems.append(f"{latest[1]} is the latest checkpoint already; save under another step")
        if keep is not None and not is_count(keep):
            problems.append(f"keep={keep!r}: keep at least 1 checkpoint (or None for all)")
        if directory.exists() and not directory.is_dir():
            problems.append(f"{directory} is a file; pass a directory for checkpoints")
        boxes = model_pieces(stage)
        moments, found = optimizer_pieces(stage, optimizer, boxes)
        problems += found + plain_data_problems(
            {"extra": extra, "scheduler": scheduler.state_dict() if scheduler is not None else None})
    except (ValueError, OSError) as exc:
        problems.append(str(exc))
    return problems, step, boxes, moments


def _state(stage: Stage, optimizer, scheduler, extra, step: int, boxes: dict, moments: dict) -> dict[str, Any]:
    """What this rank hands DCP: its boxes, moments and RNG state; rank 0 also the run's own state."""
    state: dict[str, Any] = {**{f"model/{name}": box for name, box in boxes.items()}, **moments,
                             f"rng/{dist.get_rank()}": _rng_state()}
    if dist.get_rank() == 0:
        state["optim_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        state["extra"] = extra
        mesh = stage.mesh
        state["run"] = {"mesh": {"dp": mesh.dp, "pp": mesh.pp, "cp": mesh.cp, "tp": mesh.tp},
                        "world_size": dist.get_world_size(), "step": step, "plan": str(stage.resolved.plan.source)}
    return state


def _write(state: dict, path: Path) -> tuple[str | None, bool]:
    """Collective: `state` written by DCP; (the first failure in words or None, whether it was a Ctrl-C)."""
    failed, interrupted = None, False
    try:
        dcp.save(state, checkpoint_id=path, planner=PieceSavePlanner())
    except CheckpointException as exc:  # raised on every rank alike: DCP gathers each rank's outcome
        interrupted = any(isinstance(error, KeyboardInterrupt) for error, _ in exc.failures.values())
        rank, (first, _) = next(iter(exc.failures.items()))
        failed = f"rank {rank}: {type(first).__name__}: {first}"
        if "unexpected pos" in str(first):  # torch's zip writer, when a write came up short
            failed += " (a file could not be written whole: a full disk, a quota or a file-size limit)"
    return failed, interrupted


def _finish(stage: Stage, directory: Path, path: Path, step: int, keep: int | None, tokenizer: Any,
            record: dict | None) -> str | None:
    """Rank 0, once every rank wrote its tensors: the mark (and a LoRA run's record), config and tokenizer,
    `latest`, pruning; the error."""
    try:
        write_mark(path, stage.model)
        if record is not None:
            (path / LORA_FILE).write_text(json.dumps(record, indent=1) + "\n")
        config = getattr(stage.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        point_latest(directory, path)
    except OSError as exc:
        return f"rank 0: {type(exc).__name__}: {exc}"
    if keep is not None:
        prune(directory, step, keep)
    return None


def _after_failure(directory: Path, path: Path) -> str:
    """Rank 0 removes what the failed save wrote; the words for what is left (the same on every rank)."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    found = latest_checkpoint(directory)
    free = shutil.disk_usage(directory).free if directory.is_dir() else None
    return (f"the partial {path} was removed, "
            + (f"{found[1]} is still the latest checkpoint" if found else "there is no checkpoint yet")
            + (f"; {format_bytes(free)} free on its file system now" if free is not None else ""))


def load_training_state(directory: str | Path, stage: Stage, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                        *, step: int | None = None, allow_other_model: bool = False) -> Any:
    """Restore a checkpoint of `save_training_state` into this rank's stage and optimizer; returns `extra`.

    Collective. The stage may come from another plan (tp, pp or dp) than the one that saved:
    each rank reads its boxes out of those the saving ranks wrote. The optimizer must be a
    fresh one with the same parameter groups over `stage.parameters()`; its state and
    hyperparameters are replaced. RNG states are restored when the world size is unchanged.

    Args:
        directory: the run's checkpoint directory (its latest step), or one `step-N` directory.
        stage, optimizer, scheduler: as given to `save_training_state`.
        step: load `step-N` instead of the latest.
        allow_other_model: load a state written for another model class or configuration of the
            same shapes on purpose (a transplant); by default that is refused.

    Raises:
        CheckpointError (a ValueError): on every rank, nothing of the checkpoint run: a `.metadata` or
            an object in it that would run code. Before any tensor is read: no checkpoint, or one that
            does not fit this model (missing tensors, other whole shapes) or was written for another
            model class or configuration (`allow_other_model`).

    Example:
        >>> extra = rewrite.load_training_state("ckpt", stage, optimizer, scheduler)
        >>> start = extra["step"] + 1
    """
    directory, problems, state, fresh, path = Path(directory), [], {}, [], None
    rank = dist.get_rank()
    try:
        path = checkpoint_path(directory, step)
        stored = read_metadata(path / ".metadata").state_dict_metadata  # no code of the file runs
        kind = state_kind_problems(path, stage, stored)  # a LoRA state as a full one, or the reverse
        if not allow_other_model and (changed := model_change(path, stage.model)):
            problems.append(f"{path} was written for another model: {changed}; load it into the model it was "
                            "written for, or pass allow_other_model=True to load it into this one on purpose")
        state = {f"model/{name}": box for name, box in model_pieces(stage).items()}
        moments, fresh = fresh_optimizer_pieces(stage, optimizer, state, stored)
        state.update(moments)
        problems += kind or fit_problems(state, stored)
        state.update({key: None for key in ("optim_groups", "scheduler", "extra", "run")})
        if f"rng/{rank}" in stored:
            state[f"rng/{rank}"] = None
    except (ValueError, OSError) as exc:
        problems.append(str(exc))
    agree(problems, f"load_training_state({str(directory)!r})", error=CheckpointError)  # the first collective
    if stage.resolved.plan.lora is not None and not allow_other_model:
        if other := base_problem(path, stage, share(base_sums(stage))):  # every rank alike: the same sums
            raise CheckpointError(f"load_training_state({str(directory)!r}): {path}: {other}; resume onto the base "
                                  "model it was trained on, or pass allow_other_model=True to load it onto this one")
    load_pieces(state, path)
    groups = state["optim_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: the optimizer had {len(groups)} parameter groups, this one has "
                              f"{len(optimizer.param_groups)}; build it with the same groups as the run that saved")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
    for param, values in fresh:
        optimizer.state[param] = values
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = state.get(f"rng/{rank}")
    if rng is not None and state["run"]["world_size"] == dist.get_world_size():
        _set_rng_state(rng)
    return state["extra"]
