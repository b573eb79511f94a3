"""Reproduce the shipped family deltas (LoRA adapters) from the root model.

Training on this 2-core machine takes tens of minutes, so the adapters are committed under
``orchestra/family/deltas/`` and ``orchestra family build`` only merges them. This module is the
exact code that produced them::

    orchestra family train-delta finetuned   # root + LoRA on stdlib docstrings
    orchestra family train-delta distilled   # root minus 10 layers + LoRA distilled from the root

Checkpoints go to ``<home>/train/<name>/`` every few steps, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from orchestra.family.importance import LayerImportance

__all__ = ["DeltaRecipe", "RECIPES", "train_delta", "DELTAS_DIR"]

DELTAS_DIR = Path(__file__).parent / "deltas"


@dataclass(frozen=True)
class DeltaRecipe:
    """How one shipped delta is trained."""

    name: str
    objective: str  # "lm" (next-token loss on the corpus) or "distill" (KL to the root's logits)
    steps: int
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1e-3
    rank: int = 8
    alpha: int = 16
    seed: int = 0
    drop_layers: tuple[int, ...] = ()
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    corpus: str = "stdlib_docstrings"  # or "stdlib_docstrings+licences": also the calibration licence texts
    temperature: float = 1.0  # distillation: KL between teacher and student softmaxes at this temperature
    schedule: str = "linear"  # "linear" (warm-up, then linear decay to 10%) or "cosine" (warm-up, cosine to 10%)
    warmup: int = 10
    notes: dict[str, str] = field(default_factory=dict)


RECIPES: dict[str, DeltaRecipe] = {
    "finetuned": DeltaRecipe(name="finetuned", objective="lm", steps=80, lr=1e-3),
    # The 10 layers with the smallest skip KL on the root (`measure_importance` on training text; the
    # scores are recorded in recipe.json): dropped without distillation they are far closer to the
    # root than the previous recipe's late run 18-27 or the closest run of 10 by block distance (see
    # orchestra/family/importance.py). The LoRA is then distilled from the root's logits on docstrings
    # and the calibration licences (never the held-out GPL text); the step count is what fits ~25
    # minutes on 2 shared CPU cores (recipe.json records the measured time).
    "distilled": DeltaRecipe(
        name="distilled", objective="distill", steps=24, seq_len=256, batch_size=2, lr=2e-3, rank=16, alpha=32,
        drop_layers=(3, 4, 12, 13, 14, 16, 17, 19, 25, 26), corpus="stdlib_docstrings+licences",
        schedule="cosine", warmup=3,
    ),
}


def _batches(token_ids: list[int], recipe: DeltaRecipe):
    import torch

    window = recipe.seq_len
    n_windows = len(token_ids) // window
    data = torch.tensor(token_ids[: n_windows * window]).view(n_windows, window)
    gen = torch.Generator().manual_seed(recipe.seed)
    step = 0
    while True:
        order = torch.randperm(n_windows, generator=gen)
        for start in range(0, n_windows - recipe.batch_size + 1, recipe.batch_size):
            yield step, data[order[start : start + recipe.batch_size]]
            step += 1


def importance_windows(tokenizer, count: int = 8, window: int = 256) -> list:
    """Fixed windows of the *training* corpus (stdlib docstrings) for measuring layer importance.

    The corpus' first windows: fixed for a given Python, and never the held-out GPL text.
    """
    import torch

    from orchestra.family.corpus import stdlib_docstrings

    ids = tokenizer(stdlib_docstrings())["input_ids"]
    if len(ids) < count * window:
        raise ValueError(f"the training corpus has {len(ids)} tokens, fewer than {count} windows of {window}")
    return [torch.tensor(ids[: count * window]).view(count, window)]


def measure_importance(root_dir: Path, n_drop: int):
    """The root's layer importances and the run of `n_drop` layers to drop (:mod:`orchestra.family.importance`).

    Block influence and distances over 8 x 256 training tokens (one forward pass); skip KL, a forward
    pass per layer, over the first 128 of them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestra.family import importance

    tokenizer = AutoTokenizer.from_pretrained(str(root_dir))
    model = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32).eval()
    windows = importance_windows(tokenizer)
    return importance.measure_importance(model, windows, n_drop, skip_kl_windows=[windows[0][:1, :128]])


def _lr_lambda(recipe: DeltaRecipe):
    import math

    def fn(s: int) -> float:
        warm = min(1.0, (s + 1) / max(1, recipe.warmup))
        frac = min(1.0, s / max(1, recipe.steps))
        if recipe.schedule == "cosine":
            return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        return warm * max(0.1, 1 - frac)

    return fn


@dataclass(frozen=True)
class _Training:
    """One delta's training run: the LoRA-wrapped student, its optimizer and schedule, the teacher if any."""

    name: str
    recipe: DeltaRecipe
    model: PeftModel
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    teacher: torch.nn.Module | None
    ckpt_dir: Path


def train_delta(name: str, root_dir: Path, home: Path, out_dir: Path | None = None) -> Path:
    """Train the named delta on the root model; returns the adapter directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestra.family._prune import drop_layers
    from orchestra.family.corpus import training_text

    recipe = RECIPES[name]
    out_dir = out_dir or DELTAS_DIR / name
    ckpt_dir = home / "train" / name
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)

    importance = _checked_importance(recipe, root_dir, ckpt_dir) if recipe.drop_layers else None

    tokenizer = AutoTokenizer.from_pretrained(str(root_dir))
    student = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32)
    teacher = None
    if recipe.objective == "distill":
        teacher = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    if recipe.drop_layers:
        drop_layers(student, list(recipe.drop_layers))
    lora = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0, target_modules=list(recipe.target_modules),
        bias="none", init_lora_weights=True,
    )
    model = get_peft_model(student, lora)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(recipe))
    run = _Training(name=name, recipe=recipe, model=model, optim=optim, sched=sched, teacher=teacher,
                    ckpt_dir=ckpt_dir)

    start, seconds = _resume(run)
    ids = tokenizer(training_text(recipe.corpus))["input_ids"]
    losses, seconds = _train_steps(run, ids, start, seconds)
    _write_delta(out_dir, model, name, recipe, losses, seconds, importance)
    return out_dir


def _resume(run: _Training) -> tuple[int, float]:
    """Load the last checkpoint, if any, into the run; the steps already done and their training seconds."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state_file = run.ckpt_dir / "state.json"
    if not state_file.exists():
        return 0, 0.0
    state = json.loads(state_file.read_text())
    set_peft_model_state_dict(run.model, load_file(str(run.ckpt_dir / "adapter.safetensors")))
    run.optim.load_state_dict(torch.load(run.ckpt_dir / "optim.pt", weights_only=True))
    run.sched.load_state_dict(state["sched"])
    return state["step"], state.get("seconds", 0.0)


def _train_steps(run: _Training, ids: list[int], start: int, seconds: float) -> tuple[list[float], float]:
    """Steps `start` to the recipe's last, checkpointed every 10; the losses and the total training seconds."""
    import time

    from tqdm import tqdm

    recipe = run.recipe
    run.model.train()
    bar = tqdm(total=recipe.steps, initial=start, desc=f"train {run.name}", unit="step")
    losses: list[float] = []
    tick = time.perf_counter()
    t = recipe.temperature
    for step, batch in _batches(ids, recipe):
        if step < start:
            continue  # replays the data order so a resumed run sees the same batches
        if step >= recipe.steps:
            break
        loss = _delta_loss(run.model(input_ids=batch, use_cache=False).logits, batch, run.teacher, t)
        loss.backward()
        run.optim.step()
        run.sched.step()
        run.optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if (step + 1) % 10 == 0 or step + 1 == recipe.steps:
            now = time.perf_counter()
            seconds += now - tick
            tick = now
            _save_checkpoint(run.ckpt_dir, run.model, run.optim, run.sched, step + 1, seconds, losses[-1])
    bar.close()
    return losses, seconds


def _checked_importance(recipe: DeltaRecipe, root_dir: Path, ckpt_dir: Path) -> LayerImportance:
    """The root's layer importance, measured on every (non-resumed) run and checked against the recipe's layers
    to drop: the shipped choice is the measured one. Kept with the checkpoints, so a resumed run does not
    measure again."""
    from mappings.atomic import write_atomic
    from orchestra.family.importance import LayerImportance

    cached = ckpt_dir / "importance.json"
    if cached.is_file():
        importance = LayerImportance.from_dict(json.loads(cached.read_text()))
    else:
        importance = measure_importance(root_dir, len(recipe.drop_layers))
        write_atomic(cached, json.dumps(importance.as_dict()))
    if sorted(importance.drop) != sorted(recipe.drop_layers):
        print(f"warning: measured layers to drop {sorted(importance.drop)} differ from the recipe's "
              f"{sorted(recipe.drop_layers)} (another Python's corpus or torch build?); training the recipe's")
    return importance


def _delta_loss(logits: torch.Tensor, batch: torch.Tensor, teacher: torch.nn.Module | None,
                t: float) -> torch.Tensor:
    """Next-token cross-entropy, or with a teacher the distillation KL at temperature ``t``."""
    import torch
    import torch.nn.functional as F

    if teacher is None:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    with torch.no_grad():
        t_logits = teacher(input_ids=batch, use_cache=False).logits
    # KL(teacher || student) at temperature t, scaled by t^2 so gradients keep their size (Hinton et al.)
    return F.kl_div(
        F.log_softmax(logits.flatten(0, 1) / t, -1), F.log_softmax(t_logits.flatten(0, 1) / t, -1),
        log_target=True, reduction="batchmean",
    ) * (t * t)


def _save_checkpoint(ckpt_dir: Path, model: PeftModel, optim: torch.optim.Optimizer,
                     sched: torch.optim.lr_scheduler.LRScheduler, steps: int, seconds: float, loss: float) -> None:
    """Adapter, optimizer and schedule after ``steps`` steps; the state file last, so a resume finds all three."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from mappings.atomic import write_atomic

    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()},
              str(ckpt_dir / "adapter.safetensors"))
    torch.save(optim.state_dict(), ckpt_dir / "optim.pt")
    write_atomic(ckpt_dir / "state.json", json.dumps({"step": steps, "sched": sched.state_dict(), "seconds": seconds,
                                                      "loss": loss}))


def _write_delta(out_dir: Path, model: PeftModel, name: str, recipe: DeltaRecipe, losses: list[float], seconds: float,
                 importance: LayerImportance | None) -> None:
    """The adapter and its recipe.json (recipe, last losses, training time and versions, layer importance)."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's model-card template, not ours
    meta = {
        "recipe": {**asdict(recipe), "drop_layers": list(recipe.drop_layers), "target_modules": list(recipe.target_modules)},
        "final_losses": losses[-10:],
        "train_seconds": round(seconds, 1),
        "trained_with": {"python": platform.python_version(), "torch": torch.__version__,
                         "threads": torch.get_num_threads()},
        "command": f"orchestra family train-delta {name}",
    }
    if importance is not None:
        meta["layer_importance"] = importance.as_dict()
    (out_dir / "recipe.json").write_text(json.dumps(meta, indent=2))
