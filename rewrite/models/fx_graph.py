"""Pipeline stages of any traceable module, on paper, by torch.fx.

The model is traced once; each node goes to the stage whose cut point it follows, and a stage's graph
is copied out with one tensor in and one out. Pure: `rewrite.pipeline.carve` builds the stage module.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

__all__ = ["TracedModel", "trace", "layer_sequence", "split_problems", "stage_graph", "used_targets"]


class _Tracer(fx.Tracer):
    """Keeps `leaf_types` (e.g. parallel layers) as leaves and remembers where tracing failed."""

    def __init__(self, leaf_types: tuple[type[nn.Module], ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types
        self.path: list[str] = []
        self.failed_in: str | None = None  # innermost module whose forward raised

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.path.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path[-1]
            raise
        finally:
            self.path.pop()


@dataclass
class TracedModel:
    """A traced model and, per node, the module paths it runs under."""

    graph: fx.Graph
    scopes: dict[fx.Node, list[str]]

    def module_order(self) -> list[str]:
        """Module paths in the order forward() first enters them."""
        return list(dict.fromkeys(path for node in self.graph.nodes for path in self.scopes[node]))


def trace(model: nn.Module, *, leaf_types: tuple[type[nn.Module], ...] = ()) -> TracedModel:
    """Symbolically trace `model`, not entering modules of `leaf_types`; a failure names the module and the reason."""
    tracer = _Tracer(leaf_types)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; all mean "not traceable"
        where = tracer.failed_in or None
        module = f"module {where!r} ({type(model.get_submodule(where)).__name__})" if where else "its forward()"
        raise ValueError(
            f"{type(model).__name__} cannot be split into pipeline stages: torch.fx could not trace "
            f"{module}: {type(exc).__name__}: {exc}. Make that code traceable (no Python control flow on "
            "tensor values), or use a Hugging Face LLaMA-family model, which needs no tracing"
        ) from exc
    scopes = {  # fx keys nn_module_stack by the module paths
        node: [p for p in node.meta.get("nn_module_stack", {}) if p]
        + ([node.target] if node.op in ("call_module", "get_attr") else [])
        for node in graph.nodes
    }
    return TracedModel(graph, scopes)


def layer_sequence(model: nn.Module) -> list[str]:
    """Paths of the children of the model's main layer container, for a balanced split.

    The model itself if it is an `nn.Sequential`, else its first `nn.ModuleList` or
    `nn.Sequential` with at least two children.
    """
    for path, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) >= 2:
            return [f"{path}.{name}" if path else name for name in module._modules]
    return []


def stage_of_nodes(traced: TracedModel, cuts: list[str]) -> dict[fx.Node, int]:
    """Stage index of each node: the number of cut regions entered so far."""
    stage, assignment = 0, {}
    for node in traced.graph.nodes:
        scopes = traced.scopes[node]
        while stage < len(cuts) and any(p == cuts[stage] or p.startswith(cuts[stage] + ".") for p in scopes):
            stage += 1
        assignment[node] = stage
    return assignment


def split_problems(traced: TracedModel, cuts: list[str]) -> list[str]:
    """Why this model cannot be cut at `cuts` into single-tensor stages (empty: it can)."""
    order = traced.module_order()
    problems = [f"pipeline.cut_points: {cut!r} is not a module called by forward()" for cut in cuts if cut not in order]
    if problems:
        return problems
    positions = [order.index(c) for c in cuts]
    if positions != sorted(positions):
        return [f"pipeline.cut_points: {cuts} are not in the order forward() runs them: {sorted(cuts, key=order.index)}"]
    stages = stage_of_nodes(traced, cuts)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder" and n.users]
    if len(placeholders) != 1:
        problems.append(f"the model's forward() uses {len(placeholders)} inputs; pipeline stages take one tensor")
    outputs = [n for n in traced.graph.nodes if n.op == "output"]
    if outputs and not isinstance(outputs[0].args[0], fx.Node):
        problems.append("the model's forward() must return a single tensor to be split into stages")
    for node in traced.graph.nodes:
        if node.op == "get_attr":
            users = sorted({stages[u] for u in node.users})
            if len(users) > 1:
                problems.append(f"parameter or buffer {node.target!r} is used by stages {users}; cut elsewhere")
    for s in range(1, len(cuts) + 1):
        incoming = _incoming(traced, stages, s)
        if len(incoming) != 1 or any(stages[n] != s - 1 for n in incoming):
            names = ", ".join(f"{n.name} (stage {stages[n]})" for n in incoming)
            problems.append(
                f"pipeline.cut_points[{s - 1}] {cuts[s - 1]!r}: {len(incoming)} values enter stage {s} "
                f"({names}); a stage takes exactly one tensor from the stage before it, so cut where "
                "a single tensor flows"
            )
    return problems


def _incoming(traced: TracedModel, stages: dict[fx.Node, int], s: int) -> list[fx.Node]:
    """Values produced before stage `s` and read by it (parameters excluded)."""
    return list(dict.fromkeys(
        arg for node in traced.graph.nodes if stages[node] == s and node.op != "get_attr"
        for arg in node.all_input_nodes if stages[arg] < s and arg.op != "get_attr"
    ))


def stage_graph(traced: TracedModel, cuts: list[str], s: int) -> fx.Graph:
    """The graph of stage `s`: one placeholder, this stage's nodes, one output."""
    stages = stage_of_nodes(traced, cuts)
    graph, env = fx.Graph(), {}
    if s > 0:
        (boundary,) = _incoming(traced, stages, s)
        env[boundary] = graph.placeholder("x")
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            if s == 0 and node.users:
                env[node] = graph.placeholder(node.name)
            continue
        if node.op == "output":
            continue
        owner = min((stages[u] for u in node.users), default=stages[node]) if node.op == "get_attr" else stages[node]
        if owner == s:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if s == len(cuts):
        (out,) = [n for n in traced.graph.nodes if n.op == "output"]
        graph.output(env[out.args[0]])
    else:
        (sent,) = _incoming(traced, stages, s + 1)
        graph.output(env[sent])
    graph.lint()
    return graph


def used_targets(graph: fx.Graph) -> set[str]:
    """Module and attribute paths a graph reads."""
    return {n.target for n in graph.nodes if n.op in ("call_module", "get_attr")}
