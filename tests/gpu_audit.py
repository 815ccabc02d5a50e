"""What a GPU would enforce, checked on the CPU: host reads of tensor values.

`HostReads` is a TorchDispatchMode that records every operator that hands a tensor's value
to the host: `aten._local_scalar_dense` (what `.item()`, `float()`, `int()` and `.tolist()`
of a one-element tensor call), `aten.is_nonzero` (`bool(tensor)`, `if tensor:`), and the
operators whose output size depends on values (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`, `bincount`). On a GPU
each is a device-to-host synchronisation that stalls the stream. It runs on real CPU
tensors, so it sees reads that fake tensors skip (transformers skips its mask read for a
fake tensor). Each record names the innermost frame of this package that caused it.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operators that read a value on the host: a scalar, or a count that sizes the output.
HOST_READ_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(), int(), .tolist()
    aten.is_nonzero.default,  # bool(tensor), if tensor:
    aten.nonzero.default,  # also torch.where(cond) with one argument, argwhere
    aten.masked_select.default,
    aten._unique2.default,  # torch.unique
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,  # without output_size
    aten.bincount.default,  # its length is the largest value
}


def _reads_host(func, args, kwargs) -> bool:
    if func in HOST_READ_OPS:
        return not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size"))
    if func is aten.index.Tensor:  # indexing with a boolean mask: nonzero inside
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _caller(package_only: bool = False) -> str | None:
    """The innermost frame outside torch that led here, as file:line. `package_only`: only
    when that frame is this package's (a library's own calls, such as transformers moving
    a mask to the device it is already on, are not this package's to answer for)."""
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        if "/torch/" in frame.filename or frame.filename.endswith("gpu_audit.py"):
            continue
        where = f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
        if "/pipetransformer/" in frame.filename and "/tests/" not in frame.filename:
            return where
        return None if package_only else where
    return None if package_only else "torch"


class HostReads(TorchDispatchMode):
    """Records (operator, where) for every host read while active, except of tensors whose
    storage is in `host_kept` (data pointers of tensors torch keeps on the host on a GPU
    too, such as Adam's step count: reading those costs no synchronisation).

    `casts_of`: data pointers of trained parameters; each cast of one to a low-precision
    dtype (autocast's weight copy) is counted in `casts[pointer]`."""

    def __init__(self, host_kept: set[int] = frozenset(), casts_of: set[int] = frozenset()):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.host_kept = host_kept
        self.casts_of = casts_of
        self.casts: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_host(func, args, kwargs) and _pointer(args[0]) not in self.host_kept:
            self.reads.append((func.__name__, _caller()))
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in LOW_PRECISION:
            pointer = args[0].untyped_storage().data_ptr()
            if pointer in self.casts_of:
                self.casts[pointer] = self.casts.get(pointer, 0) + 1
        return func(*args, **kwargs)


LOW_PRECISION = {torch.bfloat16, torch.float16}

# What a host copy of a device tensor is called as (each waits for the device), and the
# device-moving methods that must not block.
HOST_COPY_METHODS = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__"}
MOVES = {"to", "cuda", "copy_"}


class BlockingTransfers(TorchFunctionMode):
    """Records (method, where) for every call from this package that waits for the device:
    a copy of a tensor's values to the host, or a move between host and device without
    `non_blocking=True` (from pageable memory on a GPU it waits for the stream; the
    package's host-to-device copies go through pipe/transfer.py:to_device).

    `host_held` (a `HostHeld` active beneath this mode): where given, only a move of a tensor
    a GPU run holds on the host is a copy (a `.to(device)` of a device tensor is none), and a
    read of such a tensor waits for nothing."""

    def __init__(self, host_kept: set[int] = frozenset(), host_held=None) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []
        self.host_kept = host_kept
        self.host_held = host_held

    def _on_host(self, args) -> bool:
        return bool(args) and isinstance(args[0], torch.Tensor) and self.host_held.holds(args[0])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moving = name in MOVES and _names_a_device(name, args, kwargs)
        copying = name in HOST_COPY_METHODS and not (
            args and isinstance(args[0], torch.Tensor) and _pointer(args[0]) in self.host_kept
        )
        if self.host_held is not None:
            on_host = self._on_host(args)
            moving, copying = moving and on_host, copying and not on_host
        if copying or (moving and not kwargs.get("non_blocking", False)):
            where = _caller(package_only=True)
            if where is not None:
                self.found.append((name, where))
        return func(*args, **kwargs)


class DeviceCopies(TorchDispatchMode):
    """Records (direction, where) for every copy between the host and a device that makes the
    host wait, whoever makes it (this package or a library inside a unit's forward): seen at
    the operator level, so a library's `type_as`, `.to(device)` or `copy_` count as much as
    this package's own. Meant to run on fake CUDA tensors (entered inside FakeTensorMode),
    whose devices are what a GPU's would be: a host-to-device copy without `non_blocking`
    (from pageable memory on a GPU the host waits for the stream), and any copy from a device
    to the host. A CPU scalar tensor an operator reads (a 0-dim tensor beside device tensors)
    is read on the host, not copied: not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = target = None
        blocking = not kwargs.get("non_blocking", False)
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            source, target = args[0].device, torch.device(kwargs["device"])
        elif func is aten.copy_.default:
            target, source = args[0].device, args[1].device
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if source is not None and source.type != target.type:
            if target.type == "cpu" or blocking:
                direction = "to host" if target.type == "cpu" else "to device"
                self.found.append((direction, _caller()))
        return func(*args, **kwargs)


def _pointer(tensor: torch.Tensor) -> int | None:
    """The data pointer of a tensor's storage; None for a wrapper subclass (a DTensor)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _names_a_device(name: str, args, kwargs) -> bool:
    if name == "cuda":
        return True
    if name == "copy_":  # between devices (on this CPU there are none)
        return len(args) > 1 and args[0].device != args[1].device
    values = [*args[1:], kwargs.get("device")]
    return any(isinstance(v, (torch.device, str)) and str(v) != "" for v in values if v)


# Functions that make a tensor from host values; without `device=` it is made on the host,
# on a GPU run too.
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.from_numpy,
}


class HostHeld(TorchFunctionMode):
    """Which tensors a GPU run would hold on the host, followed on a CPU run where every
    tensor is on the host: one made by a factory without `device=` (`torch.tensor([rss])`)
    or by `.cpu()` or `mark`ed (a dataset's batches), and what is computed from such tensors
    alone, until `.to(device)` or `.cuda()` moves it. Tensors made before the mode or
    elsewhere (a loader worker) are not followed (never reported). `CollectiveAudit` refuses
    these on NCCL's groups."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self._on_host = WeakIdKeyDictionary()

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor in self._on_host

    def mark(self, *tensors: torch.Tensor) -> None:
        """Tensors the caller knows a GPU run holds on the host (what a dataset yields)."""
        for tensor in tensors:
            self._on_host[tensor] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func in FACTORIES:
            host = kwargs.get("device") is None
        elif name in MOVES and name != "copy_" and _names_a_device(name, args, kwargs):
            host = False  # moved to the device the call names
        elif name == "cpu":
            host = True
        elif name.endswith("_"):  # in place: the tensor stays where it is
            return out
        else:
            inputs = [t for t in _tensors((*args, *kwargs.values()))]
            host = bool(inputs) and all(self.holds(t) for t in inputs)
        for tensor in _tensors((out,)):
            if host:
                self._on_host[tensor] = True
            else:
                self._on_host.pop(tensor, None)
        return out


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


# ----------------------------------------------------------------------------- collectives

# Dtypes NCCL reduces and sends (torch maps bool to uint8).
NCCL_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
}
TENSOR_OPS = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # FSDP2's
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
]
OBJECT_OPS = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "send_object_list",
    "recv_object_list",
    "barrier",
]


POINT_TO_POINT = {
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
}


def collective_order_problem(collectives: dict[int, list]) -> str | None:
    """Where two ranks' collectives (`CollectiveAudit.collectives` of each rank) on the
    groups they share differ in order, op or tensors, or None."""
    for a, seen_a in collectives.items():
        for b, seen_b in collectives.items():
            if b <= a:
                continue
            on_a = [c for c in seen_a if a in c[0] and b in c[0]]
            on_b = [c for c in seen_b if a in c[0] and b in c[0]]
            for index, (x, y) in enumerate(zip(on_a, on_b)):
                if x != y:
                    return f"ranks {a} and {b}, shared collective {index}: {x} against {y}"
            if len(on_a) != len(on_b):
                return f"ranks {a} and {b} issue {len(on_a)} and {len(on_b)} shared collectives"
    return None


class CollectiveAudit:
    """Wraps torch.distributed's collectives and point-to-point ops (and the pipeline's
    batched p2p) to check what NCCL would insist on, and records every group creation.

    - the control group (gloo on a GPU run): CPU tensors only;
    - the default group and the training groups (NCCL on a GPU run): tensors on the rank's
      compute device, in a dtype NCCL takes, and no object collectives or barriers (they
      belong on the control group);
    - with `host_held`, no tensor made on the host (`HostHeld`) on those groups;
    - `groups`: every new_group / split_group call as (kind, ranks, backend), to compare
      between ranks (each must make the same calls in the same order);
    - `collectives`: every collective (not point-to-point) in the order this rank issued it,
      as (the group's ranks, op, shapes and dtypes): any two ranks must issue the ones of the
      groups they share in the same order with the same tensors (`collective_order_problem`),
      or NCCL pairs the wrong calls and hangs or reduces garbage.

    On this CPU the compute device is the CPU, so what fails here is a dtype NCCL refuses, a
    control message on a training or default group, or ranks creating groups differently;
    the control group must be its own group for the first to show (the test makes it so)."""

    def __init__(self, device: torch.device, control_group) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.device = device
        self.control_group = control_group
        self.violations: list[str] = []
        self.groups: list[tuple[str, tuple, str]] = []
        self.counts: dict[str, int] = {}
        self.collectives: list[tuple[tuple[int, ...], str, tuple]] = []
        self._saved: dict[str, object] = {}
        # Where set, a tensor it says a GPU run holds on the host is refused on the default
        # and training groups (NCCL's): what a CPU run's devices cannot show.
        self.host_held: HostHeld | None = None

    def _kind(self, group) -> str:
        if group is not None and group is self.control_group:
            return "control"
        if group is None or group is self.dist.group.WORLD:
            return "default"
        return "training"

    def _check(self, op: str, group, tensors) -> None:
        kind = self._kind(group)
        self.counts[f"{kind}:{op}"] = self.counts.get(f"{kind}:{op}", 0) + 1
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            if kind == "control" and tensor.device.type != "cpu":
                self.violations.append(f"{op} on the control group with a {tensor.device} tensor")
            if kind != "control":
                if tensor.device != self.device and tensor.device.type != self.device.type:
                    self.violations.append(
                        f"{op} on the {kind} group with a {tensor.device} tensor"
                    )
                if tensor.dtype not in NCCL_DTYPES:
                    self.violations.append(f"{op} on the {kind} group with {tensor.dtype}")
                if self.host_held is not None and self.host_held.holds(tensor):
                    self.violations.append(
                        f"{op} on the {kind} group with a tensor a GPU run holds on the host"
                    )
        if kind != "control" and op in OBJECT_OPS:
            self.violations.append(f"{op} on the {kind} group (a control message)")
        if op not in POINT_TO_POINT:
            ranks = tuple(self.dist.get_process_group_ranks(group or self.dist.group.WORLD))
            shapes = tuple(
                (tuple(t.shape), str(t.dtype)) for t in tensors if isinstance(t, torch.Tensor)
            )
            self.collectives.append((ranks, op, shapes))

    def install(self) -> None:
        dist = self.dist
        for name in TENSOR_OPS + OBJECT_OPS + ["batch_isend_irecv", "new_group", "split_group"]:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
        for name in TENSOR_OPS:
            if name in self._saved and name not in ("isend", "irecv"):  # P2POp checks these
                setattr(dist, name, self._tensor_op(name, self._saved[name]))
        for name in OBJECT_OPS:
            if name in self._saved:
                setattr(dist, name, self._object_op(name, self._saved[name]))
        dist.batch_isend_irecv = self._batched(self._saved["batch_isend_irecv"])
        dist.new_group = self._creation("new_group", self._saved["new_group"])
        dist.split_group = self._creation("split_group", self._saved["split_group"])

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.dist, name, fn)

    def _tensor_op(self, name, fn):
        def op(*args, **kwargs):  # FSDP2 passes everything by keyword
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, self.dist.ProcessGroup)), None)
            tensors = []
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                elif isinstance(value, (list, tuple)):
                    tensors += [t for t in value if isinstance(t, torch.Tensor)]
            self._check(name, group, tensors)
            return fn(*args, **kwargs)

        return op

    def _object_op(self, name, fn):
        def op(*args, **kwargs):
            self._check(name, kwargs.get("group"), [])
            return fn(*args, **kwargs)

        return op

    def _batched(self, fn):
        def op(p2p_ops):
            for p2p in p2p_ops:
                self._check("batch_isend_irecv", p2p.group, [p2p.tensor])
            return fn(p2p_ops)

        return op

    def _creation(self, name, fn):
        def create(*args, **kwargs):
            ranks = kwargs.get("ranks", kwargs.get("split_ranks", args[0] if args else None))
            ranks = tuple(map(tuple, ranks)) if name == "split_group" else tuple(ranks or ())
            self.groups.append((name, ranks, str(kwargs.get("backend"))))
            return fn(*args, **kwargs)

        return create


class PipelineTraffic(TorchDispatchMode):
    """What a stretch of pipeline steps sends, receives and allocates, on gloo: every
    point-to-point op on the wire (`ProcessGroup.send` and `recv`, whoever posts them:
    torch's schedules, batched or not, and their warm-up vote), the warm-up votes
    (`PipelineStage._warmup_forward_vote`: an int32 exchange and a `.item()`), the stages'
    forward set-ups (`_prepare_forward_infra`: receive buffers allocated) and every tensor
    allocated by a factory operator (`aten.empty*`, `zeros`, `full`, ...). Counts by name."""

    ALLOCATING = ("empty", "empty_strided", "zeros", "ones", "full", "new_empty", "new_zeros")

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _wrap(self, owner, name: str, counted: str) -> None:
        method = getattr(owner, name)
        self._saved.append((owner, name, method))

        def wrapped(*args, **kwargs):
            self._count(counted)
            return method(*args, **kwargs)

        setattr(owner, name, wrapped)

    def __enter__(self):
        from torch.distributed import ProcessGroup
        from torch.distributed.pipelining.stage import PipelineStage

        self._wrap(ProcessGroup, "send", "p2p_sends")
        self._wrap(ProcessGroup, "recv", "p2p_recvs")
        self._wrap(PipelineStage, "_warmup_forward_vote", "warm_up_votes")
        self._wrap(PipelineStage, "_prepare_forward_infra", "forward_set_ups")
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, method in reversed(self._saved):
            setattr(owner, name, method)
        self._saved.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.ALLOCATING:
            self._count("allocations")
        return func(*args, **(kwargs or {}))


class FakeCudaStreams:
    """torch.cuda's streams and events, and `Tensor.record_stream`, on a machine without CUDA
    (with FakeTensorMode's CUDA tensors), each call logged in order to `log`:

        ("copy", stream)            a tensor moved to a CUDA device while `stream` is current
        ("use", stream)             a CUDA tensor converted (`.float()`) on `stream`
        ("record", event, stream)   an event recorded on a stream
        ("wait_event", stream, e)   a stream told to wait for an event (no host wait)
        ("host_wait", event)        the host waiting for an event (`synchronize`)
        ("record_stream", stream)   a tensor marked as used on a stream

    Streams are named "compute" (the current one to start with) and "side1", "side2", ...
    in the order they are made; events "e1", "e2", ...; `events=False` leaves
    torch.cuda.Event as it is (a test that fakes events itself)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.made = {"side": 0, "e": 0}
        self.current = "compute"

    def install(self, monkeypatch, events: bool = True, copies: bool = True) -> None:
        from contextlib import contextmanager

        fake = self

        class Stream:
            def __init__(self, device=None, priority=0) -> None:
                fake.made["side"] += 1
                self.name = f"side{fake.made['side']}"

            def wait_event(self, event) -> None:
                fake.log.append(("wait_event", self.name, getattr(event, "name", event)))

            def wait_stream(self, other) -> None:
                fake.log.append(("wait_stream", self.name, other.name))

        class Current(Stream):
            def __init__(self, name: str) -> None:
                self.name = name

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                fake.made["e"] += 1
                self.name = f"e{fake.made['e']}"

            def record(self, stream=None) -> None:
                where = stream.name if stream is not None else fake.current
                fake.log.append(("record", self.name, where))

            def synchronize(self) -> None:
                fake.log.append(("host_wait", self.name))

        @contextmanager
        def stream(chosen):
            before, fake.current = fake.current, chosen.name
            try:
                yield
            finally:
                fake.current = before

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current(fake.current))
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(
            torch.Tensor,
            "record_stream",
            lambda tensor, s: fake.log.append(("record_stream", s.name)),
        )
        if events:
            monkeypatch.setattr(torch.cuda, "Event", Event)
        if copies:
            to, as_float = torch.Tensor.to, torch.Tensor.float

            def logged_to(tensor, *args, **kwargs):
                out = to(tensor, *args, **kwargs)
                if out.device.type == "cuda" and tensor.device.type != "cuda":
                    fake.log.append(("copy", fake.current))
                return out

            def logged_float(tensor, *args, **kwargs):
                if tensor.device.type == "cuda":
                    fake.log.append(("use", fake.current))
                return as_float(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, "to", logged_to)
            monkeypatch.setattr(torch.Tensor, "float", logged_float)
