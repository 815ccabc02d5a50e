"""The GPU audits over compiled code: what inductor lowers, read from its graphs.

While a `TorchDispatchMode` is active dynamo does not run a compiled graph: it runs the
unit's Python eagerly (tests/test_compiled_audit.py shows it), so gpu_audit.HostReads and
the copy audits never see compiled units. `GraphAudit` is a dynamo backend that is inductor
up to code generation: `compile_fx` (inductor's decompositions, its pre-grad and joint-graph
passes, AOTAutograd's min-cut partition into a forward and a backward graph, or one graph for
inference) with an inner compiler that records each graph before it is lowered, then runs it
as it is (`codegen=False`, seconds on this CPU) or hands it to inductor's own
`compile_fx_inner` (`codegen=True`: C++ kernels generated with gcc, minutes). What the
audits read from a recorded graph:

- host reads: the operators gpu_audit.HOST_READ_OPS names (and indexing by a boolean
  mask); inside a graph they are what a compiled step would wait for;
- device moves: a copy whose source is on another device than its target, a tensor made on
  a device other than the graph's, a constant tensor held on another device;
- weight casts: a parameter (an input inductor treats as static: `static_input_idxs`)
  converted to bfloat16 or float16, what autocast's cast of a weight becomes in a graph,
  where its per-region cache does not apply.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from functorch.compile import make_boxed_func
from gpu_audit import HOST_READ_OPS

LOW_PRECISION = (torch.bfloat16, torch.float16)
_CASTS = {"convert_element_type", "_to_copy"}
_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "arange", "scalar_tensor"}


@dataclass
class Graph:
    kind: str  # 'forward', 'backward' or 'inference'
    module: torch.fx.GraphModule
    static_inputs: tuple[int, ...]  # indices of the inputs inductor keeps static (parameters)

    def nodes(self):
        return [n for n in self.module.graph.nodes if n.op == "call_function"]

    def host_reads(self) -> list[str]:
        found = []
        for node in self.nodes():
            if node.target in HOST_READ_OPS:
                found.append(str(node.target))
            elif node.target is torch.ops.aten.index.Tensor and any(
                index is not None and _value(index).dtype in (torch.bool, torch.uint8)
                for index in node.args[1]
            ):
                found.append("index by a boolean mask")
        return found

    def device_moves(self, device: torch.device) -> list[str]:
        """Copies between devices, and tensors made or held on another device than `device`.
        A 0-dim host tensor beside device tensors is a scalar the kernel reads on the host
        (DeBERTa's attention scale, `torch.tensor(size, dtype=float)`): not a copy, as
        gpu_audit.DeviceCopies counts it."""
        found = []
        for node in self.nodes():
            name = _name(node)
            target = node.kwargs.get("device")
            if target is None:
                continue
            if name in _CASTS and _value(node.args[0]).device != torch.device(target):
                found.append(f"{node.format_node()} (from {_value(node.args[0]).device})")
            elif name in _FACTORIES and torch.device(target) != device and _value(node).dim():
                found.append(node.format_node())
        for name, constant in self.module.named_buffers():
            if constant.device != device and constant.dim() > 0:
                found.append(f"constant {name} on {constant.device}")
        return found

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "placeholder"]

    def weight_casts(self) -> int:
        """Parameters (static inputs of a forward or inference graph) converted to a
        low-precision dtype in this graph."""
        placeholders = self.placeholders()
        weights = {placeholders[i] for i in self.static_inputs if i < len(placeholders)}
        casts = 0
        for node in self.nodes():
            name = _name(node)
            dtype = node.args[1] if name == "convert_element_type" else node.kwargs.get("dtype")
            if name in _CASTS and dtype in LOW_PRECISION and node.args[0] in weights:
                casts += 1
        return casts

    def saved_low_precision(self) -> list[tuple[int, ...]]:
        """Shapes of the low-precision tensors a backward graph takes from its forward:
        what each micro-batch in flight holds until its backward."""
        return [
            tuple(_value(p).shape)
            for p in self.placeholders()
            if not p.name.startswith("tangents")
            and isinstance(_value(p), torch.Tensor)
            and _value(p).dtype in LOW_PRECISION
        ]


def _name(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _value(node) -> torch.Tensor:
    return node.meta["val"]


class GraphAudit:
    """A dynamo backend (register it: `torch._dynamo.register_backend`) recording every
    graph inductor would lower, in order (module docstring)."""

    def __init__(self, codegen: bool = False) -> None:
        self.codegen = codegen
        self.graphs: list[Graph] = []

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        # AOTAutograd's and inductor's on-disk caches would serve a graph compiled before
        # (another test, another run) without calling the inner compiler: nothing recorded.
        with (
            torch._functorch.config.patch(enable_autograd_cache=False),
            torch._inductor.config.patch(fx_graph_cache=False),
        ):
            return compile_fx(graph_module, example_inputs, inner_compile=self._inner)

    def _inner(self, graph_module, example_inputs, **kwargs):
        kind = "forward"
        if kwargs.get("is_inference"):
            kind = "inference"
        elif kwargs.get("is_backward"):
            kind = "backward"
        static = tuple(kwargs.get("static_input_idxs") or ())
        self.graphs.append(Graph(kind, graph_module, static))
        if self.codegen:
            from torch._inductor.compile_fx import compile_fx_inner

            return compile_fx_inner(graph_module, example_inputs, **kwargs)
        return make_boxed_func(graph_module.forward)

    def kinds(self) -> Counter[str]:
        return Counter(graph.kind for graph in self.graphs)


def forward_graphs_on(device: torch.device, call) -> list[Graph]:
    """The graphs of `call()` compiled for inference (autograd off) with inductor's
    decompositions, on fake tensors of `device` (a CUDA device on a machine without one: the
    backward cannot be traced there, docs/pytorch.md); `call(backend)` compiles and runs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs: list[Graph] = []

    def record(graph_module, example_inputs):
        graphs.append(Graph("inference", graph_module, ()))
        return make_boxed_func(graph_module.forward)

    call(
        aot_autograd(
            fw_compiler=record, inference_compiler=record, decompositions=select_decomp_table()
        )
    )
    return graphs
