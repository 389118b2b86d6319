"""Tensor-parallel rules bound to a model: expansion, shapes, and the checks they need. Pure; used by `resolve`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..models.blocks import ATTENTION, MLP
from ..models.families import embedding_scale
from ..models.names import tied_modules
from ..plan.schema import ParallelPlan
from .shard_layout import WHOLE, TensorSplit
from ..plan.styles import COLUMN_STYLES, SPLIT_OUTPUT_STYLES, STYLE_INFO, WHOLE_STYLES, packed_parts
from .heads import fitting_tps, head_counts, head_problems, is_split_kv, kv_groups_problems, kv_replicas_of
from .latent_attention import latent_problems
from .tp_params import kept_whole, parameter_problem
from ..plan.wording import either
from ..plan.patterns import match_pattern, unmatched_problem

__all__ = ["TpRules", "ShardSpec", "shard_problems"]

_FITS = "the sizes at which every module the plan shards splits evenly, heads whole"


@dataclass(frozen=True)
class ShardSpec:
    """One module to rewrite: its path, style, the rule that chose it, per-rank shapes."""

    fqn: str
    style: str
    pattern: str  # the plan's rule, or "(implied)" for per-head modules of a sharded attention
    in_features: int | None  # None for grad_allreduce modules
    out_features: int | None
    bias: bool
    weight_shape: tuple[int, ...] | None  # on each rank
    bias_shape: tuple[int, ...] | None  # on each rank
    replicas: int = 1  # tp ranks holding each slice: a k/v projection past its kv heads, tp / kv
    tp: int = 1  # the plan's mesh.tp
    parameter: bool = False  # `fqn` names a bare parameter (attention sinks), split along dim 0 (`tp_params`)

    @property
    def slices(self) -> int:
        """Distinct slices over the tp ranks: rank `i` holds slice `i // replicas`."""
        return self.tp // self.replicas


@dataclass(frozen=True)
class TpRules:
    """All that binding the tensor_parallel rules reads of a plan: tp, the rules, the lines naming them.

    Hashable: a plan search keeps bindings by it, and what is not here cannot be read (nor left out of that key).
    """

    tp: int
    rules: tuple[tuple[str, str], ...]  # (pattern, style), in the plan's order
    lines: tuple[str, ...] = ()  # per rule, "line 7: " when the plan came from a file
    tp_line: str = ""

    @classmethod
    def of(cls, plan: ParallelPlan) -> TpRules:
        rules = tuple(plan.tensor_parallel.items())
        return cls(plan.mesh.tp, rules, tuple(plan.where("tensor_parallel", p) for p, _ in rules), plan.where("mesh", "tp"))

    def at(self, pattern: str) -> str:
        """The line of the rule for `pattern` ('' for an implied one or a plan without a file)."""
        return dict(zip((p for p, _ in self.rules), self.lines)).get(pattern, "")


def shard_problems(
    rules: TpRules, model: nn.Module, modules: dict[str, nn.Module], notes: list[str] | None = None
) -> tuple[list, list[str]]:
    """Every module the tensor_parallel rules shard, and every problem with them (each starting with its
    rule's line when the plan came from a file)."""
    tp, problems = rules.tp, []
    chosen, params = _matched(rules, model, modules, problems, notes)
    if tp > 1:
        implied, whole_problems = kept_whole(modules, {f: s for f, (_, s) in [*chosen.items(), *params.items()]})
        problems += whole_problems + latent_problems(model, modules, chosen, tp, rules.at)
        for fqn in implied:
            chosen.setdefault(fqn, ("(implied)", "grad_allreduce"))
    order = {name: i for i, name in enumerate(modules)}
    styles, fitting = {f: st for f, (_, st) in chosen.items()}, []

    def fits() -> list[int]:  # every size refusal names the same tp sizes: those the whole plan fits, heads too
        if not fitting:
            fitting.extend(fitting_tps(model, modules, styles))
        return fitting

    shards = [_module_shard(model, modules, styles, fqn, pattern, style, rules, fits, problems)
              for fqn, (pattern, style) in sorted(chosen.items(), key=lambda item: order[item[0]])]  # model order
    shards += _parameter_shards(model, params, styles, tp, rules, problems)
    if tp > 1:
        rule_at = {s.fqn: rules.at(s.pattern) for s in shards if s.pattern != "(implied)"}
        bound = {s.fqn: s.style for s in shards}
        problems += _tied_problems(tied_modules(model), bound, rule_at)
        problems += _block_problems(model, bound, tp, rule_at, rules.tp_line)
    return shards, problems


def _matched(rules: TpRules, model: nn.Module, modules: dict[str, nn.Module], problems: list[str],
             notes: list[str] | None) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """(pattern, style) per module path and per bare parameter the rules choose; problems added to `problems`."""
    chosen, params, names = {}, {}, list(modules)
    for pattern, style in rules.rules:
        at = rules.at(pattern)
        hits = [fqn for fqn in names if fqn and match_pattern(pattern, fqn)]
        if not hits:
            found = [n for n, _ in model.named_parameters() if match_pattern(pattern, n)]
            params.update((n, (pattern, style)) for n in found)  # bare parameters (attention sinks)
            problems += [] if found else [unmatched_problem(at, "tensor_parallel", pattern, names)]
        for fqn in hits:
            module = modules[fqn]
            if STYLE_INFO[style].layer == "experts":
                continue  # fused experts (by expert over ep, or each over tp): bound by `experts.expert_problems`
            if style == "grad_allreduce":
                if notes is not None and not any(True for _ in module.parameters()):  # nothing to sum: say so
                    notes.append(f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, which has no parameters: "
                                 "there is no gradient to sum, so the rule changes nothing there")
                continue
            problem = _module_problem(at, pattern, style, fqn, module)
            if problem:
                problems.append(problem)
            elif fqn in chosen and chosen[fqn][1] != style:
                other, other_style = chosen[fqn]
                problems.append(f"{at}{fqn!r} is matched by tensor_parallel[{other!r}] as {other_style!r} and by "
                                f"tensor_parallel[{pattern!r}] as {style!r}; keep one style per module")
            else:
                chosen.setdefault(fqn, (pattern, style))
    return chosen, params


def _module_problem(at: str, pattern: str, style: str, fqn: str, module: nn.Module) -> str | None:
    """Why `style` cannot shard `module` (an embedding only as 'vocab', a linear only otherwise), or None."""
    if style == "vocab" and not isinstance(module, nn.Embedding):
        return (f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, a {type(module).__name__}; style 'vocab' "
                "shards an nn.Embedding's rows")
    if style == "vocab" and type(module).forward is not nn.Embedding.forward and embedding_scale(module) is None:
        return (f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, a {type(module).__name__}, whose forward does "
                "more than look up rows (and scale them, as Gemma's scaled embedding does, which 'vocab' keeps); "
                "style 'vocab' would drop that: leave the embedding whole")
    if isinstance(module, nn.Embedding) and style != "vocab":
        return (f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, an nn.Embedding, as {style!r}; "
                "embeddings are sharded with style 'vocab' (HF: embedding_rowwise)")
    if style != "vocab" and not isinstance(module, nn.Linear):
        linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n]
        hint = f"; its linears: {', '.join(linears[:4])}" if linears else ""
        return (f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, a {type(module).__name__}, not an "
                f"nn.Linear; only linears can be sharded{hint}")
    return None


def _module_shard(model: nn.Module, modules: dict[str, nn.Module], styles: dict[str, str], fqn: str, pattern: str,
                  style: str, rules: TpRules, fits, problems: list[str]) -> ShardSpec:
    """The `ShardSpec` of module `fqn` under `style`; a size tp does not divide is added to `problems`."""
    lin, tp = modules[fqn], rules.tp
    if style in WHOLE_STYLES:
        weight = getattr(lin, "weight", None)
        shape = tuple(weight.shape) if isinstance(weight, nn.Parameter) else None
        return ShardSpec(fqn, style, pattern, None, None, False, shape, None)
    at = rules.at(pattern)
    if style == "vocab":
        rows, dim = lin.num_embeddings, lin.embedding_dim
        if rows % tp:
            problems.append(f"{at}{fqn} (vocab): num_embeddings={rows} is not divisible by mesh.tp={tp}; "
                            f"use tp {either(fits())} ({_FITS}), or leave the embedding whole")
        return ShardSpec(fqn, style, pattern, rows, dim, False, TensorSplit(0, tp).local_shape((rows, dim)), None, 1, tp)
    split_out, parts = style in COLUMN_STYLES, packed_parts(style)
    replicas = kv_replicas_of(model, modules, fqn, tp) if is_split_kv(fqn, styles) else 1
    slices = tp // replicas
    dim, size = ("out_features", lin.out_features) if split_out else ("in_features", lin.in_features)
    if parts > 1 and size % (parts * tp):
        problems.append(f"{at}{fqn} ({style}): out_features={size} must be {parts} equal parts, each divisible by "
                        f"mesh.tp={tp}; use tp {either(fits())} ({_FITS}), or shard it as 'column_gather'")
    elif size % slices:
        problems.append(f"{at}{fqn} ({style}): {dim}={size}{_dim_meaning(model, size)} is not divisible by "
                        f"mesh.tp={tp}; use tp {either(fits())} ({_FITS}), or leave {fqn.rsplit('.', 1)[-1]} whole")
    split = TensorSplit(0 if split_out else 1, slices, parts, replicas)
    weight = split.local_shape((lin.out_features, lin.in_features))
    bias = None if lin.bias is None else (split if split_out else WHOLE).local_shape((lin.out_features,))
    return ShardSpec(fqn, style, pattern, lin.in_features, lin.out_features, lin.bias is not None, weight, bias,
                     replicas, tp)


def _parameter_shards(model: nn.Module, params: dict[str, tuple[str, str]], styles: dict[str, str], tp: int,
                      rules: TpRules, problems: list[str]) -> list[ShardSpec]:
    """The bare parameters the rules split (`tp_params`), their problems added to `problems`."""
    found, shards = dict(model.named_parameters()), []
    for name, (pattern, style) in params.items():
        param = found[name]
        problem = parameter_problem(name, param, style, tp, f"{rules.at(pattern)}tensor_parallel[{pattern!r}]", styles)
        if problem:
            problems.append(problem)
            continue
        local = TensorSplit(0, tp).local_shape(tuple(param.shape))
        shards.append(ShardSpec(name, style, pattern, None, param.shape[0], False, local, None, 1, tp, parameter=True))
    return shards


def _dim_meaning(model: nn.Module, size: int) -> str:
    """' (the vocabulary)' or ' (intermediate_size)' when the config says what a dimension is, else ''."""
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None) == size:
        return " (the vocabulary)"
    return next((f" ({key})" for key in ("intermediate_size", "hidden_size") if getattr(config, key, None) == size), "")


def _tied_problems(tied: dict[str, str], styles: dict[str, str], rule_at: dict[str, str]) -> list[str]:
    """A shared matrix stays one matrix: both ends whole, or both split along the vocabulary alike ('vocab'
    embedding and 'column' head keep the same rows of the shared `[vocab, hidden]` weight on each rank)."""
    problems = []
    for fqn, other in tied.items():
        owner = other.rsplit(".", 1)[0]
        ends = {fqn: styles.get(fqn), owner: styles.get(owner)}
        if not any(ends.values()):
            continue
        kinds = {"vocab" if s == "vocab" else "rows" if s in ("column", "column_gather") else str(s) for s in ends.values()}
        if kinds == {"rows", "vocab"}:
            continue  # embedding by vocabulary rows, head by output rows: the same slices
        found = ", ".join(f"{name}={style or 'unsharded'}" for name, style in ends.items())
        at = next((rule_at[name] for name in ends if rule_at.get(name)), "")
        problems.append(f"{at}{fqn}.weight is tied to {other} ({found}); sharding one end alone would untie them. "
                        "Shard the embedding as 'vocab' and the head as 'column' together, leave both whole, or build "
                        "the model with tie_word_embeddings=False")
    return problems


def _block_problems(
    model: nn.Module, styles: dict[str, str], tp: int, rule_at: dict[str, str], tp_at: str
) -> list[str]:
    """Attention and MLP blocks must be sharded as a whole, heads intact. `rule_at`: per sharded module, the
    line prefix of its rule; `tp_at`: that of mesh.tp."""
    problems, config = [], getattr(model, "config", None)
    parents = sorted({fqn.rsplit(".", 1)[0] for fqn in styles if "." in fqn})
    for parent in parents:
        for block in (ATTENTION, MLP):
            inputs, output, members = block.inputs, block.output, block.members
            got = {m: styles.get(f"{parent}.{m}") for m in members}
            if not any(got.values()) or not all(hasattr(model.get_submodule(parent), m) for m in members):
                continue
            reads_split = got[output] in STYLE_INFO and STYLE_INFO[got[output]].input_sharded
            if len({got[m] in SPLIT_OUTPUT_STYLES for m in inputs} | {reads_split}) > 1:
                found = ", ".join(f"{m}={got[m] or 'unsharded'}" for m in members)
                at = next((rule_at[f"{parent}.{m}"] for m in members if rule_at.get(f"{parent}.{m}")), "")
                problems.append(f"{at}{parent}: {found}; shard {', '.join(inputs)} as column and {output} as row "
                                "together (the column outputs are the row layer's sharded input)")
            if block.kv and config is not None and got[block.splitter] in SPLIT_OUTPUT_STYLES:
                k_features = getattr(model.get_submodule(f"{parent}.{block.kv[0]}"), "out_features", None)
                problems += (head_problems(config, tp, tp_at, k_features)
                             or kv_groups_problems(model, parent, head_counts(config, k_features), tp, tp_at))
    return list(dict.fromkeys(problems))  # each config problem once, not once per layer

