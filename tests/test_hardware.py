"""The named-hardware table (planning/hardware.yaml, read by planning/hardware.py): every row
cites its source, the figures are dense and in the units their names say, and a malformed row
or an unknown name is a one-line error that says what is wrong and where.

Unit tier: no processes, no devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipetransformer.planning import hardware
from pipetransformer.planning.hardware import Device, Link, load_hardware

GIB = 2**30
TABLE = load_hardware()

REQUIRED_DEVICES = {
    "quadro-rtx-5000",
    "v100-16gb",
    "v100-32gb",
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "l4",
    "cpu-2core",
}
REQUIRED_LINKS = {
    "pcie3-x16",
    "pcie4-x16",
    "pcie5-x16",
    "nvlink2",
    "nvlink3",
    "nvlink4",
    "infiniband-cx353a",
    "infiniband-edr",
    "infiniband-hdr",
    "infiniband-ndr",
    "ethernet-10g",
    "ethernet-25g",
    "ethernet-100g",
    "loopback",
}


def test_the_packaged_file_sits_beside_the_module_and_holds_the_required_rows():
    assert (Path(hardware.__file__).parent / "hardware.yaml").is_file()
    assert REQUIRED_DEVICES <= set(TABLE.devices)
    assert REQUIRED_LINKS <= set(TABLE.links)
    assert all(isinstance(row, Device) for row in TABLE.devices.values())
    assert all(isinstance(row, Link) for row in TABLE.links.values())


def test_every_row_cites_a_source():
    for row in [*TABLE.devices.values(), *TABLE.links.values()]:
        assert len(row.source) > 20, row.name
        # A published figure names its address; a derived or measured one says so.
        assert "https://" in row.source or "measured" in row.source.lower(), row.name


def test_gpu_rows_cite_a_vendor_document_and_record_fp16():
    for name in REQUIRED_DEVICES - {"cpu-2core"}:
        row = TABLE.device(name)
        assert "nvidia.com" in row.source, name
        assert row.peak_fp16_tflops is not None, name


def test_generations_rank_as_published():
    h100, a100, v100 = (
        TABLE.device("h100-sxm"),
        TABLE.device("a100-80gb"),
        TABLE.device("v100-32gb"),
    )
    assert h100.peak_flops("bfloat16") > a100.peak_flops("bfloat16") > v100.peak_flops("float32")
    assert h100.memory_bytes_per_s > a100.memory_bytes_per_s > v100.memory_bytes_per_s
    quadro = TABLE.device("quadro-rtx-5000")
    assert (
        v100.peak_flops("float32")
        > quadro.peak_flops("float32")
        > TABLE.device("cpu-2core").peak_flops("float32")
    )


def test_tensor_peaks_are_dense():
    # NVIDIA prints A100 / H100 / L4 tensor figures "with sparsity" (2x); halved, BF16 is twice
    # TF32 on every such part. Halving one and not the other would give a ratio of 1 or 4.
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "l4"):
        row = TABLE.device(name)
        assert row.peak_bf16_tflops == pytest.approx(2 * row.peak_tf32_tflops, rel=0.02), name
        assert row.peak_fp16_tflops == row.peak_bf16_tflops, name
    assert TABLE.device("h100-sxm").peak_flops("bfloat16") == pytest.approx(1979e12 / 2)
    assert TABLE.device("a100-40gb").peak_flops("tf32") == pytest.approx(156e12)


def test_devices_without_tensor_formats_fall_back_to_fp32():
    for name in ("quadro-rtx-5000", "v100-16gb", "v100-32gb"):
        row = TABLE.device(name)
        assert row.peak_tf32_tflops is None and row.peak_bf16_tflops is None, name
        assert row.peak_flops("bfloat16") == row.peak_flops("tf32") == row.peak_flops("float32")
        assert row.peak_flops("float16") > 5 * row.peak_flops("float32"), name  # FP16 tensor cores
    cpu = TABLE.device("cpu-2core")
    assert cpu.peak_flops("bfloat16") == cpu.peak_flops("float16") == cpu.peak_flops("float32")


def test_si_values():
    quadro = TABLE.device("quadro-rtx-5000")
    assert quadro.peak_flops("float32") == pytest.approx(11.2e12)
    assert quadro.memory_bytes_per_s == pytest.approx(448e9)
    pcie3 = TABLE.link("pcie3-x16")
    assert pcie3.bytes_per_s == pytest.approx(15.754e9)
    assert pcie3.latency_s == pytest.approx(pcie3.latency_us * 1e-6)
    # cores x clock x FP32 FLOPs per cycle, as its source says.
    assert TABLE.device("cpu-2core").peak_flops("float32") == pytest.approx(2 * 2.0e9 * 32)


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="float64.*known: float32, tf32, bfloat16, float16"):
        TABLE.device("l4").peak_flops("float64")


def test_memory_sizes_are_the_named_sizes_in_gib():
    expected = {
        "quadro-rtx-5000": 16,
        "v100-16gb": 16,
        "v100-32gb": 32,
        "a100-40gb": 40,
        "a100-80gb": 80,
        "h100-sxm": 80,
        "l4": 24,
    }
    for name, gib in expected.items():
        assert TABLE.device(name).memory_bytes == gib * GIB, name
        assert isinstance(TABLE.device(name).memory_bytes, int)


def test_pcie_rates_follow_the_standard():
    # 8 / 16 / 32 GT/s per lane, 16 lanes, 128b/130b encoding, 8 bits a byte.
    for name, gigatransfers in (("pcie3-x16", 8), ("pcie4-x16", 16), ("pcie5-x16", 32)):
        expected = gigatransfers * 16 * 128 / 130 / 8
        assert TABLE.link(name).bandwidth_gbps == pytest.approx(expected, abs=5e-4), name
    assert TABLE.link("pcie3-x16").bandwidth_gbps == 15.754


def test_the_papers_links_are_labelled_as_the_paper_states_them():
    """Section 4.1: PCIe 3.0 x16 at 15.754 GB/s in a node, InfiniBand CX353A at 5 GB/s
    between the two; only those rows say they are the paper's."""
    paper = TABLE.link("infiniband-cx353a")
    assert paper.bandwidth_gbps == 5.0 and "5 GB/s" in paper.description
    assert TABLE.link("pcie3-x16").bandwidth_gbps == 15.754
    labelled = {
        name for name, row in TABLE.links.items() if "PipeTransformer paper" in row.description
    }
    assert labelled == {"pcie3-x16", "infiniband-cx353a"}
    assert TABLE.link("infiniband-edr").bandwidth_gbps > paper.bandwidth_gbps


def test_links_rank_as_published():
    gbps = {name: row.bandwidth_gbps for name, row in TABLE.links.items()}
    assert (
        gbps["nvlink4"] > gbps["nvlink3"] > gbps["nvlink2"] > gbps["pcie5-x16"] > gbps["pcie4-x16"]
    )
    assert gbps["pcie4-x16"] > gbps["pcie3-x16"]
    assert (
        gbps["infiniband-ndr"]
        > gbps["infiniband-hdr"]
        > gbps["infiniband-edr"]
        == gbps["ethernet-100g"]
    )
    assert gbps["ethernet-100g"] == 10 * gbps["ethernet-10g"] == 4 * gbps["ethernet-25g"]
    latency = {name: row.latency_us for name, row in TABLE.links.items()}
    assert (
        latency["nvlink4"]
        < latency["pcie3-x16"]
        < latency["infiniband-edr"]
        < latency["ethernet-10g"]
    )


def test_names_are_lowercase_words_joined_by_hyphens():
    for name in [*TABLE.devices, *TABLE.links]:
        assert hardware.NAME_PATTERN.match(name), name


@pytest.mark.parametrize("kind", ["device", "link"])
def test_an_unknown_name_lists_the_known_ones_on_one_line(kind):
    rows = TABLE.devices if kind == "device" else TABLE.links
    with pytest.raises(ValueError) as error:
        getattr(hardware, kind)("tpu-v9")  # the module-level lookup of the packaged table
    message = str(error.value)
    assert "\n" not in message and "'tpu-v9'" in message
    assert all(name in message for name in rows)


def _rows() -> dict:
    """A small valid table as plain data, to break one key at a time."""
    return {
        "devices": [
            {
                "name": "test-gpu",
                "description": "a test row",
                "peak_fp32_tflops": 10.0,
                "peak_tf32_tflops": None,
                "peak_bf16_tflops": 100.0,
                "peak_fp16_tflops": 100.0,
                "memory_bandwidth_gbps": 500.0,
                "memory_bytes": 8 * GIB,
                "source": "a data sheet",
            },
        ],
        "links": [
            {
                "name": "test-link",
                "description": "a test link",
                "bandwidth_gbps": 10.0,
                "latency_us": 0.0,
                "source": "a standard",
                "notes": "zero latency is allowed",
            },
        ],
    }


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_valid_file_elsewhere_loads(tmp_path):
    table = load_hardware(_write(tmp_path, _rows()))
    assert table.device("test-gpu").peak_flops("tf32") == pytest.approx(10e12)
    assert table.device("test-gpu").notes == ""
    assert table.link("test-link").latency_s == 0.0


@pytest.mark.parametrize(
    ("section", "change", "row", "key", "says"),
    [
        ("devices", {"peak_fp32_tflops": -1.0}, "test-gpu", "peak_fp32_tflops", "> 0"),
        (
            "devices",
            {"memory_bandwidth_gbps": "fast"},
            "test-gpu",
            "memory_bandwidth_gbps",
            "a number",
        ),
        ("devices", {"memory_bandwidth_gbps": 0}, "test-gpu", "memory_bandwidth_gbps", "> 0"),
        ("devices", {"memory_bytes": 8.5e9}, "test-gpu", "memory_bytes", "a whole number"),
        ("devices", {"peak_bf16_tflops": True}, "test-gpu", "peak_bf16_tflops", "a number"),
        ("devices", {"peak_fp32_tflops": None}, "test-gpu", "peak_fp32_tflops", "a number"),
        ("devices", {"peak_fp16_tflops": float("nan")}, "test-gpu", "peak_fp16_tflops", "a number"),
        ("devices", {"source": ""}, "test-gpu", "source", "non-empty string"),
        ("devices", {"clock_ghz": 1.5}, "test-gpu", "clock_ghz", "unknown key"),
        ("devices", {"name": "Test_GPU"}, "Test_GPU", "name", "hyphens"),
        ("links", {"latency_us": -0.5}, "test-link", "latency_us", ">= 0"),
        ("links", {"bandwidth_gbps": None}, "test-link", "bandwidth_gbps", "a number"),
    ],
)
def test_a_malformed_row_names_the_row_and_key(tmp_path, section, change, row, key, says):
    data = _rows()
    data[section][0].update(change)
    with pytest.raises(ValueError) as error:
        load_hardware(_write(tmp_path, data))
    message = str(error.value)
    assert f"{section} row '{row}'" in message and f"'{key}'" in message and says in message


@pytest.mark.parametrize(("section", "key"), [("devices", "memory_bytes"), ("links", "source")])
def test_a_missing_key_names_the_row_and_key(tmp_path, section, key):
    data = _rows()
    del data[section][0][key]
    with pytest.raises(ValueError, match=rf"{section} row '\S+': missing key '{key}'"):
        load_hardware(_write(tmp_path, data))


def test_a_row_without_a_name_is_named_by_its_position(tmp_path):
    data = _rows()
    data["links"].append({**data["links"][0]})
    del data["links"][1]["name"]
    with pytest.raises(ValueError, match=r"links\[1\]: missing key 'name'"):
        load_hardware(_write(tmp_path, data))


def test_a_name_twice_is_an_error(tmp_path):
    data = _rows()
    data["devices"].append({**data["devices"][0]})
    with pytest.raises(ValueError, match="devices row 'test-gpu'.*appears twice"):
        load_hardware(_write(tmp_path, data))


def test_an_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown section 'nodes'"):
        load_hardware(_write(tmp_path, {**_rows(), "nodes": []}))


def test_the_table_is_read_only():
    with pytest.raises(TypeError):
        TABLE.devices["l4"] = TABLE.device("h100-sxm")  # type: ignore[index]
