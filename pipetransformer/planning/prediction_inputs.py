"""`plan --predict`'s flags turned into predict()'s inputs: the cluster (named hardware from
hardware.yaml or stated bandwidths), the unit profile and its unit times (a measured profile,
or the model's analytical profile through a roofline on the named device), and the number of
training samples an epoch, each with a line saying where it came from. The model's spec
is built once here (`prediction_unit_times`) and handed on with the profile, to predict().

Which unit profile: a measured one wins when a profile file has one for this model (the
file `--profile` names, else pipeline.profile_path, else the newest of the files runs under
./runs wrote: runs/profiles/profiles.json and every RUN_DIR/profiles.json), unless
`--device` names a device of another type than the one it was measured on; then, or when
there is none, the analytical profile on the named device. Without `--device` a measured
profile is needed, and the error says how to get one or to name a device.

Owns: `cluster_from_flags`, `prediction_unit_times`, `find_unit_profile`, `calibrated_times`,
`measured_on`, `train_samples_for`.
Must not: predict (predict.py), measure anything, or download data or weights.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.autopipe.planner import balance
from pipetransformer.autopipe.profiles import (
    ProfileError,
    ProfileStore,
    UnitProfile,
    UnitProfileKey,
    unit_costs_from_profile,
)
from pipetransformer.config import TABLE_DATASETS, Config, ConfigError, DataConfig, resolve
from pipetransformer.models import ModelSpec, build_model
from pipetransformer.planning.analytical import analytical_profile
from pipetransformer.planning.cluster import (
    INTER_NODE_GBPS,
    INTRA_NODE_GBPS,
    Cluster,
    unit_times,
)
from pipetransformer.planning.context import (
    describe_model,
    model_build_args,
    profiling_micro_batch_size,
)
from pipetransformer.planning.hardware import Device, Link, device, link, packaged_hardware
from pipetransformer.planning.profile_keys import (
    PLAN_PROFILE_PATH,
    model_signature_for,
    profile_path_for,
)
from pipetransformer.planning.roofline import (
    PRECISION_PEAKS,
    AchievedFractions,
    matmul_peak,
    roofline_profile,
)
from pipetransformer.planning.step_model import (
    Links,
    UnitTimes,
    calibrate_overhead,
    predict_step,
)

# A GPU's memory bandwidth when neither --memory-gbps nor --device says it.
MEMORY_GBPS = 2000.0
# Words of a hardware.yaml device name that a GPU's reported name need not contain.
_FORM_FACTORS = frozenset({"sxm", "pcie"})

# Training-split sizes of the datasets a config may fetch, for predicting where the data is
# not on disk (no download just to count it).
PUBLISHED_TRAIN_SAMPLES: dict[str, tuple[int, str]] = {
    "imagefolder": (
        1_281_167,
        "ImageNet-1k's 1,281,167 training images (Russakovsky et al., IJCV 2015)",
    ),
    "cifar10": (50_000, "CIFAR-10's 50,000 training images (Krizhevsky, 2009)"),
    "cifar100": (50_000, "CIFAR-100's 50,000 training images (Krizhevsky, 2009)"),
    "sst2": (67_349, "SST-2's 67,349 training sentences (GLUE, Wang et al., 2018)"),
    # A question whose context is longer than a window gives several: a lower bound.
    "squad": (87_599, "SQuAD v1.1's 87,599 training questions, one window each at least"),
}


@dataclass(frozen=True)
class PredictionProfile:
    """The unit profile a prediction uses, its unit times, where they came from and the
    model's spec they were found by (predict() takes it from here)."""

    profile: UnitProfile
    times: UnitTimes
    source: str
    spec: ModelSpec


# ----------------------------------------------------------------------------- the cluster


def _named_device(name: str) -> Device:
    try:
        return device(name)
    except ValueError as exc:  # names the known ones
        raise ConfigError(f"--device: {exc}") from None


def _named_link(name: str, flag: str) -> Link:
    try:
        return link(name)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _bandwidth(
    name: str | None, gbps: float | None, default_gbps: float, flag: str
) -> tuple[float, float | None]:
    """(bytes/s, latency in s or None) of a named link or a stated bandwidth."""
    if name is not None and gbps is not None:
        raise ConfigError(
            f"{flag} and {flag}-gbps exclude each other: the link {name!r} names its bandwidth"
        )
    if name is None:
        return (default_gbps if gbps is None else gbps) * 1e9, None
    named = _named_link(name, flag)
    return named.bytes_per_s, named.latency_s


def cluster_from_flags(
    nodes: int,
    devices_per_node: int,
    *,
    device_name: str | None = None,
    intra_node: str | None = None,
    inter_node: str | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
) -> Cluster:
    """The cluster of `--nodes`, `--devices-per-node`, `--device` and the links: a named
    link (hardware.yaml) or its `-gbps` bandwidth, not both; unknown names are one-line
    ConfigErrors listing the known ones."""
    if nodes < 1 or devices_per_node < 1:
        raise ConfigError("--nodes and --devices-per-node must be >= 1")
    named_device = _named_device(device_name) if device_name else None
    intra_bps, intra_latency = _bandwidth(
        intra_node, intra_node_gbps, INTRA_NODE_GBPS, "--intra-node"
    )
    inter_bps, inter_latency = _bandwidth(
        inter_node, inter_node_gbps, INTER_NODE_GBPS, "--inter-node"
    )
    links = Links(intra_bps, inter_bps)
    if intra_latency is not None:
        links = dataclasses.replace(links, latency_s=intra_latency)
    if inter_latency is not None:
        links = dataclasses.replace(links, inter_node_latency_s=inter_latency)
    return Cluster(nodes, devices_per_node, links, named_device, intra_node, inter_node)


# ----------------------------------------------------------------------------- unit times


def measured_on(named: Device, profile_device: str) -> bool:
    """Whether a profile keyed with `profile_device` ('cpu', 'cuda' or 'cuda:<GPU name>',
    profile_keys.py) was measured on a device of `named`'s type: a CPU row matches 'cpu'; a
    GPU row matches a GPU name holding every word of the row's name but its form factor
    ('quadro-rtx-5000' ~ 'Quadro RTX 5000', 'a100-80gb' ~ 'NVIDIA A100-SXM4-80GB')."""
    if named.name.startswith("cpu"):
        return profile_device == "cpu"
    if not profile_device.startswith("cuda:"):
        return False  # 'cuda' alone does not say which GPU
    words = set(re.findall(r"[a-z0-9]+", profile_device.lower()))
    return set(named.name.split("-")) - _FORM_FACTORS <= words


def find_unit_profile(
    config: Config, spec: ModelSpec, path: Path
) -> tuple[UnitProfile, UnitProfileKey, ProfileStore]:
    """This model's unit profile from a profile file: (profile, its key, the file's store).
    Prefers the largest micro-batch measured on a GPU, else any device."""
    signature = model_signature_for(config, spec)
    store = ProfileStore(path).load()
    keys = [k for k in store.unit_profile_keys() if k.model == signature]
    if not keys:
        raise ConfigError(
            f"--profile: {path} has no unit profile of this model ({config.model.name}); "
            "a run of this config writes one (RUN_DIR/profiles.json)"
        )
    keys.sort(key=lambda k: (k.device.startswith("cuda"), k.micro_batch_size))
    return store.unit_profile(keys[-1]), keys[-1], store


def calibrated_times(
    config: Config, store: ProfileStore, profile_key: UnitProfileKey, times: UnitTimes, links: Links
) -> UnitTimes:
    """`times` with the per-step and per-slot overhead calibrated from the whole steps the
    trainer timed for this model on the profile's device (micro-batch timings: forward and
    backward of the initial layout, nothing frozen)."""
    costs = unit_costs_from_profile(store.unit_profile(profile_key))
    gaps = []
    for key in store.micro_batch_keys():
        if (key.model, key.device) != (
            profile_key.model,
            profile_key.device,
        ) or key.num_frozen_layers is not None:
            continue
        plan = balance(costs, 0, key.pipe_len)
        if config.trainer.batch_per_replica is None:
            replicas = max(1, config.trainer.global_batch_size // key.replica_batch)
        else:  # the timed layout's replicas, on the run's one node
            replicas = max(1, config.nproc_per_node // key.pipe_len)
        for m, seconds in store.micro_batch_timings(key).items():
            step = predict_step(
                times,
                plan,
                micro_batch_size=key.replica_batch // m,
                num_micro_batches=m,
                dp_degree=replicas,
                replicas_per_node=replicas,
                links=links,
                cached_prefix=False,
            )
            gaps.append((m + key.pipe_len - 1, seconds - (step.step_s - step.overhead_s)))
    per_step, per_slot = calibrate_overhead(gaps)
    return dataclasses.replace(times, step_overhead_s=per_step, slot_overhead_s=per_slot)


def roofline_unit_profile(
    config: Config, named: Device, world_size: int, fractions: AchievedFractions | None = None
) -> UnitProfile:
    """The config's model counted on the meta device (no weights, no download) at the run's
    profiling micro-batch size, timed by the roofline on `named` in the run's precision.
    The caller has described the model (describe_model: a bad one is one ConfigError line);
    counting needs its modules, not its spec."""
    model = build_model(config.model, device="meta", **model_build_args(config))
    micro_batch_size = profiling_micro_batch_size(config, world_size)
    work = analytical_profile(model, micro_batch_size, PRECISION_PEAKS[config.trainer.precision])
    peak = matmul_peak(config.trainer.precision, config.trainer.tf32)
    return roofline_profile(work, named, fractions, peak)


def _roofline_source(config: Config, named: Device, fractions: AchievedFractions) -> str:
    dtype = matmul_peak(config.trainer.precision, config.trainer.tf32)
    return (
        f"analytical, roofline on {named.name} ({dtype} peak "
        f"{named.peak_flops(dtype) / 1e12:g} TFLOP/s x {fractions.compute:g}, memory "
        f"{named.memory_bandwidth_gbps:g} GB/s x {fractions.memory:g})"
    )


def prediction_unit_times(
    config: Config,
    cluster: Cluster,
    profile_path: str | None = None,
    memory_gbps: float | None = None,
    fractions: AchievedFractions | None = None,
) -> PredictionProfile:
    """The unit profile and unit times to predict `config` on `cluster` with (see the module
    docstring for which), and the model's spec, built here once. The optimizer's memory
    bandwidth: `memory_gbps`, else the named device's achieved bandwidth, else MEMORY_GBPS."""
    spec = describe_model(config)  # a bad model or freeze setting: one ConfigError line
    fractions = fractions or AchievedFractions()
    named = cluster.device
    if named is not None and memory_gbps is not None:
        raise ConfigError(
            f"--memory-gbps and --device exclude each other: {named.name} names its bandwidth"
        )
    if named is None:
        bandwidth = (MEMORY_GBPS if memory_gbps is None else memory_gbps) * 1e9
    else:
        bandwidth = named.memory_bytes_per_s * fractions.memory
    path = Path(profile_path) if profile_path else profile_path_for(config)
    try:
        if profile_path or config.pipeline.profile_path is not None:
            profile, key, store = find_unit_profile(config, spec, path)
        else:
            path, (profile, key, store) = _newest_run_profile(config, spec)
    except ConfigError:
        if named is None or profile_path:
            raise  # no device to fall back on, or the file asked for lacks this model
        profile = key = None
    resolved = resolve(config, cluster.world())
    if profile is not None and (named is None or measured_on(named, key.device)):
        times = calibrated_times(config, store, key, unit_times(profile, bandwidth), cluster.links)
        return PredictionProfile(profile, times, f"{path} [{key.device}]", spec)
    source = _roofline_source(config, named, fractions)
    if profile is not None:
        source += f"; {path} holds one measured on {key.device}, not a {named.name}"
    profile = roofline_unit_profile(resolved, named, cluster.world_size, fractions)
    return PredictionProfile(profile, unit_times(profile, bandwidth), source, spec)


def _newest_run_profile(
    config: Config, spec: ModelSpec, runs: Path = PLAN_PROFILE_PATH.parent.parent
) -> tuple[Path, tuple[UnitProfile, UnitProfileKey, ProfileStore]]:
    """The newest profile file under `runs` (modification time) with a unit profile of this
    model: runs/profiles/profiles.json, a run's RUN_DIR/profiles.json, a compare's variants'.
    Raises ConfigError naming the model and both ways to a prediction when none has one."""
    files = sorted(
        (
            p
            for p in runs.rglob("profiles.json")
            if p.is_file() and "checkpoints" not in p.relative_to(runs).parts  # copies
        )
        if runs.is_dir()
        else (),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for path in files:
        try:
            return path, find_unit_profile(config, spec, path)
        except (ConfigError, ProfileError):  # another model's, or unreadable: the next
            continue
    where = f"{len(files)} profile file(s) under {runs}/" if files else f"no {runs}/ here"
    raise ConfigError(
        f"plan --predict: no measured unit profile of this model ({config.model.name}; "
        f"{where}): name a device to predict from its data sheet, --device NAME (one of "
        f"{', '.join(packaged_hardware().devices)}), or train this config once and pass "
        "--profile RUN_DIR/profiles.json"
    )


# ----------------------------------------------------------------------------- steps


def _data_on_disk(data: DataConfig) -> bool:
    if data.name == "digits":
        return True  # bundled with scikit-learn
    if data.name in TABLE_DATASETS:
        return True  # a user's table: its files, or `datasets`' copy of a hub dataset
    if data.root is None:
        return False
    root = Path(data.root).expanduser()
    return (root / "train").is_dir() if data.name == "imagefolder" else root.exists()


def train_samples_for(config: Config) -> tuple[int, str]:
    """Training samples an epoch and where the count came from: the training data when it
    is on disk, else the dataset's published training-split size (at most
    data.train_subset)."""
    data = config.data
    samples = None
    if _data_on_disk(data):
        from pipetransformer.data import build_data

        try:
            samples = len(
                build_data(
                    dataclasses.replace(data, download=False),
                    seed=config.trainer.seed,
                    model_name_or_path=config.model.model_name_or_path,
                ).train
            )
            source = f"the training data in {data.root or data.path}"
            if data.name == "digits":
                source = "scikit-learn's digits"
        except FileNotFoundError:  # a directory without the dataset in it
            samples = None
        except ValueError as exc:  # a table that cannot be read: no published size to use
            if data.name not in TABLE_DATASETS:
                raise
            raise ConfigError(str(exc)) from None
    if samples is None:
        samples, source = PUBLISHED_TRAIN_SAMPLES[data.name]
        source = f"{source}; the data is not on disk"
        if data.train_subset is not None and data.train_subset < samples:
            samples, source = data.train_subset, f"data.train_subset of {source}"
    return samples, source
