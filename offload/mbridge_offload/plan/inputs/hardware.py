"""GPU and host presets for the memory and time models — data, not code.

Every figure is a public vendor or platform value (see ``docs/planner.md``): HBM
capacity, the GPU↔host link per direction, the host memory bandwidth and CPU cores available *per GPU* on the usual
8-GPU node (a node's sockets shared by its GPUs). Effective figures (what a pinned copy or STREAM reaches) are
derived from the theoretical ones with the efficiencies below, so a user can override either. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# Achieved fraction of theoretical bandwidth: pinned copies of large blocks run 20-40 % below the PCIe figure;
# STREAM reaches 70-85 % of the DRAM figure (published STREAM results). We take the middle of each range.
LINK_EFFICIENCY = 0.70
HOST_MEMORY_EFFICIENCY = 0.80
# The share of a node's host RAM the planner lets the offload buffers of all its GPUs take (an assumption, set by
# evidence). Pinned (page-locked) memory cannot be swapped or reclaimed, and the rest of the node needs room: the OS
# and page cache, the data loader's workers, NCCL's and the driver's host buffers, checkpoint staging. The largest
# share a published run is known to work with: Megatron Bridge 0.6.2's Llama 3 70B GB200 FP8 perf recipe
# (40 layers offloaded, MBS 1, seq 8192) needs 169 GB of pinned host memory per GPU here (the caching host allocator's
# power-of-two blocks) of the 240 GB a GB200 has per GPU: 70.5 %; rounded up to 72 %. Beyond it no published run
# says the node still works, so no offload beyond it is offered (the cross-check: Llama 3.1 405B's recipe moved to
# B200 would need 185 GB per GPU, 74 % of a 2 TB DGX B200, and is refused).
PINNED_HOST_SHARE = 0.72
# The share of the allocatable GPU memory a recommendation keeps free (``margin``; an estimate's "fits" has none), set
# by the same evidence: NVIDIA's published recipes must count as fitting with it, or recommend would refuse what
# NVIDIA runs. The tightest is Megatron Bridge 0.6.2's Llama 3 70B 64-GPU GB200 FP8-CS perf recipe (Megatron-FSDP,
# 40 layers offloaded): 177.3 GiB predicted of 181.2 GiB allocatable, 2.2 % free (its output layer's backward: the
# logits' gradient beside the weight-sized gradient megatron-core returns, plan/memory/activations.py); every other
# published layer-offload recipe (Llama 3 70B on 64 B200 / GB200 / GB300, Llama 3.1 405B on 128 / 256 B300 / GB300)
# keeps more (5.1 % to 18 %). 2.2 % rounded down: 2 %. (Bridge's 32-GPU Llama 3 70B variants are the 64-GPU recipes
# with the global batch cut, "legacy-scaled GBS", not published benchmarks; the tests say which of them exceed it.)
DEFAULT_MARGIN = 0.02


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator as the planner sees it.

    Attributes:
        name: preset key (lowercase, e.g. ``h100-80gb``).
        hbm_gb: GPU memory in GB (10⁹ bytes), the marketed size.
        link_gbps: theoretical GPU↔host bandwidth per direction, GB/s (PCIe Gen5 x16 = 63, NVLink-C2C = 450).
        host_bw_gbps: theoretical host DRAM bandwidth available to one GPU's rank, GB/s.
        cpu_cores: CPU cores per GPU (node cores / GPUs per node).
        peak_tflops: dense bf16 tensor-core peak, TFLOP/s (used for the baseline step time only).
        host_ram_gb: host RAM per GPU, GB: the node's RAM over its GPUs (the pinned-memory check).
        capacity_gib: what the device exposes to CUDA (``torch.cuda.mem_get_info()[1] / 2**30``), GiB.
        cpu_adam_params_per_s_per_core: CPU AdamW rate of one core of the node's CPU, or None (then the
            calibration file or the timing default applies).
    """

    name: str
    hbm_gb: float
    link_gbps: float
    host_bw_gbps: float
    cpu_cores: int
    peak_tflops: float
    host_ram_gb: float
    description: str = ""
    capacity_gib: float = 0.0
    cpu_adam_params_per_s_per_core: float | None = None
    # Measured per-direction host-link figures (GB/s, what a pinned copy reaches), where upstream published them;
    # they replace ``link_gbps × LINK_EFFICIENCY`` for that direction.
    measured_d2h_gbps: float | None = None
    measured_h2d_gbps: float | None = None
    source: str = ""
    # The step-time model's figures (plan/time/terms.py), from the datasheets named in ``link_source``:
    # ``fp8_tflops`` the dense FP8 tensor-core peak (0 = no FP8,
    # FP8 runs at the bf16 peak); ``nvlink_gbps`` the GPU-GPU NVLink bandwidth per direction; ``nvlink_domain`` how
    # many GPUs share one NVLink domain (8 in an HGX/DGX node, 72 in an NVL72 rack); ``network_gbps`` the scale-out
    # NIC bandwidth per GPU per direction (what a collective that leaves the NVLink domain is limited by). The
    # defaults are an 8-GPU HGX/DGX node with one 400 Gb/s NIC per GPU; the presets state only what differs.
    fp8_tflops: float = 0.0
    nvlink_gbps: float = 450.0
    nvlink_domain: int = 8
    network_gbps: float = 50.0
    link_source: str = ""
    # GPUs that share one node's host RAM (``host_ram_gb × gpus_per_node`` is the node's), and where both come from.
    gpus_per_node: int = 8
    host_source: str = ""

    @property
    def host_ram_node_gb(self) -> float:
        """The host RAM of one node, GB: what the offload buffers of all its GPUs share."""
        return self.host_ram_gb * self.gpus_per_node

    @property
    def capacity_bytes(self) -> float:
        """Device memory CUDA exposes, bytes (the marketed size when no exposed figure is known)."""
        return self.capacity_gib * 2**30 if self.capacity_gib else self.hbm_gb * 1e9

    @property
    def link_effective_gbps(self) -> float:
        """The slower direction (what a round trip through the host is limited by)."""
        return min(self.d2h_effective_gbps, self.h2d_effective_gbps)

    @property
    def d2h_effective_gbps(self) -> float:
        return self.measured_d2h_gbps or self.link_gbps * LINK_EFFICIENCY

    @property
    def h2d_effective_gbps(self) -> float:
        return self.measured_h2d_gbps or self.link_gbps * LINK_EFFICIENCY

    @property
    def host_bw_effective_gbps(self) -> float:
        return self.host_bw_gbps * HOST_MEMORY_EFFICIENCY


# CPU AdamW rate of one Sapphire Rapids core as HDO runs it, fitted (least squares on the step factors) to the
# upstream card's no-overlap fraction sweep, whose nodes are the H100 preset's host
# (mbridge_offload_tools/evidence/data/published.yaml;
# tools/mbridge_offload_tools/evidence/published.py refits it and a test checks the two agree).
SAPPHIRE_RAPIDS_ADAM = 0.705e9

# capacity_gib: what CUDA exposes (PyTorch's OOM message "GPU 0 has a total capacity of X GiB" on that GPU, as
# reported in public issues); below the marketed size because the driver and ECC keep part of the HBM. ``source``
# says where each figure comes from (docs/planner.md renders it).
_PCIE5 = "host link PCIe Gen5 x16 (63 GB/s per direction nominal, x LINK_EFFICIENCY)"
_C2C = "NVLink-C2C, 900 GB/s bidirectional = 450 GB/s per direction nominal"
_MCORE_6491 = "NVIDIA/Megatron-LM#6491 comments (nvbandwidth, 4-GPU nodes, all GPUs copying at once, 2026-08)"
# Step-time model figures (GpuPreset.fp8_tflops ... network_gbps), one datasheet line each. NVLink figures are
# NVIDIA's "total bandwidth" (both directions) halved; NIC figures are the line rate of the one NIC per GPU / 8.
_H100_LINKS = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM): FP8 1,979 TFLOPS dense (3,958 with sparsity), NVLink 900 GB/s; "
    "DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s (50 GB/s per GPU), NVLink domain = the 8-GPU node"
)
_GH200_LINKS = (
    "NVIDIA GH200 Grace Hopper Superchip datasheet: FP8 1,979 TFLOPS dense, NVLink 900 GB/s; one GPU per node "
    "assumed (NVLink domain 1), scale-out over one ConnectX-7 400 Gb/s (50 GB/s)"
)
_GB200_LINKS = (
    "NVIDIA GB200 NVL72 datasheet: FP8 360 PFLOPS dense per 72 GPUs (5,000 per GPU), fifth-generation NVLink 1.8 TB/s "
    "per GPU, 72-GPU NVLink domain; ConnectX-7 400 Gb/s per GPU (50 GB/s) scale-out"
)
_GB300_LINKS = (
    "NVIDIA GB300 NVL72 datasheet: FP8 360 PFLOPS dense per 72 GPUs (5,000 per GPU), NVLink 1.8 TB/s per GPU, 72-GPU "
    "NVLink domain; ConnectX-8 SuperNIC 800 Gb/s per GPU (100 GB/s)"
)
_B200_LINKS = (
    "NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training per 8 GPUs (9,000 sparse = 4,500 dense per GPU), NVLink "
    "1.8 TB/s per GPU (14.4 TB/s aggregate), 8 x ConnectX-7 400 Gb/s (50 GB/s per GPU)"
)
_B300_LINKS = (
    "NVIDIA DGX B300 datasheet: 72 PFLOPS FP8 training per 8 GPUs (4,500 dense per GPU), NVLink 1.8 TB/s per GPU, "
    "8 x ConnectX-8 800 Gb/s (100 GB/s per GPU)"
)
_A100_LINKS = (
    "NVIDIA A100 datasheet (SXM): no FP8 (FP8 runs at the bf16 peak), NVLink 600 GB/s; DGX A100 datasheet: "
    "8 x ConnectX-6 200 Gb/s HDR (25 GB/s per GPU)"
)
GPU_PRESETS: dict[str, GpuPreset] = {
    # DGX/HGX H100: 2 x Xeon 8480C (56 cores, 8 x DDR5-4800 = 307 GB/s each), 2 TB RAM, Gen5 x16 per GPU.
    "h100-80gb": GpuPreset(
        "h100-80gb",
        80.0,
        63.0,
        2 * 307.2 / 8,
        14,
        989.0,
        250.0,
        "H100 SXM 80 GB, PCIe Gen5 host link, 2-socket Sapphire Rapids node",
        capacity_gib=79.11,
        cpu_adam_params_per_s_per_core=SAPPHIRE_RAPIDS_ADAM,
        source=f"capacity 79.11 GiB: PyTorch OOM messages on H100 80 GB; {_PCIE5}; DGX H100 datasheet (host)",
        fp8_tflops=1979.0,
        link_source=_H100_LINKS,
        host_source="DGX H100 datasheet: 2 TB system memory for 8 GPUs",
    ),
    # HGX H200: same host platform as H100 (Emerald Rapids DDR5-5600 nodes are also common).
    "h200-141gb": GpuPreset(
        "h200-141gb",
        141.0,
        63.0,
        2 * 307.2 / 8,
        14,
        989.0,
        250.0,
        "H200 SXM 141 GB, PCIe Gen5 host link, 2-socket Sapphire Rapids node",
        capacity_gib=139.80,
        cpu_adam_params_per_s_per_core=SAPPHIRE_RAPIDS_ADAM,
        source=f"capacity 139.80 GiB: PyTorch OOM messages on H200; {_PCIE5}",
        fp8_tflops=1979.0,
        link_source=_H100_LINKS,
        host_source="DGX H200 datasheet: 2 TB system memory for 8 GPUs",
    ),
    # GH200: one Grace (72 cores, ~500 GB/s LPDDR5X, 480 GB) per Hopper, NVLink-C2C. The link is asymmetric in
    # practice: GPU->CPU ~170 GB/s, CPU->GPU ~415 GB/s measured.
    "gh200": GpuPreset(
        "gh200",
        96.0,
        450.0,
        500.0,
        72,
        989.0,
        480.0,
        "GH200 Grace Hopper (96 GB HBM3), NVLink-C2C, one Grace per GPU",
        measured_d2h_gbps=170.0,
        measured_h2d_gbps=415.0,
        source=f"{_C2C}; measured D2H 169.9-170.1 GB/s, H2D 411-421 GB/s: {_MCORE_6491}; capacity: marketed 96 GB "
        "(no exposed figure known)",
        fp8_tflops=1979.0,
        nvlink_domain=1,
        link_source=_GH200_LINKS,
        gpus_per_node=1,
        host_source="GH200 Grace Hopper superchip: up to 480 GB LPDDR5X for its one GPU",
    ),
    # GB200 NVL72: one Grace (72 cores, 480 GB LPDDR5X, ~512 GB/s) per two Blackwell GPUs.
    "gb200": GpuPreset(
        "gb200",
        186.0,
        450.0,
        512.0 / 2,
        36,
        2500.0,
        240.0,
        "GB200 (186 GB HBM3e), NVLink-C2C, one Grace per two GPUs",
        capacity_gib=184.31,
        measured_d2h_gbps=176.0,
        measured_h2d_gbps=176.0,
        source=f"capacity 184.31 GiB: PyTorch OOM messages on GB200 in public issues; {_C2C}; measured 176 GB/s "
        f"CPU->GPU with all GPUs of a Grace pair copying ({_MCORE_6491}); GPU->CPU not published, assumed the same",
        fp8_tflops=5000.0,
        nvlink_gbps=900.0,
        nvlink_domain=72,
        link_source=_GB200_LINKS,
        gpus_per_node=4,
        host_source="GB200 NVL72: up to 17 TB LPDDR5X over 36 Grace CPUs (about 480 GB each), two GPUs per "
        "Grace; a compute tray holds two Graces and four GPUs",
    ),
    # GB300 NVL72: Grace as in GB200, Blackwell Ultra 288 GB HBM3e.
    "gb300": GpuPreset(
        "gb300",
        288.0,
        450.0,
        512.0 / 2,
        36,
        2500.0,
        240.0,
        "GB300 (288 GB HBM3e), NVLink-C2C, one Grace per two GPUs",
        capacity_gib=267.69,
        measured_d2h_gbps=182.9,
        measured_h2d_gbps=172.0,
        source=f"{_C2C}; measured all_to_host 181.9-183.9 GB/s, host_to_all 168.6-175.4 GB/s ({_MCORE_6491}); "
        "capacity: no GB300 figure published, assumed the B300's 267.69 GiB (the same 288 GB HBM3e)",
        fp8_tflops=5000.0,
        nvlink_gbps=900.0,
        nvlink_domain=72,
        network_gbps=100.0,
        link_source=_GB300_LINKS,
        gpus_per_node=4,
        host_source="GB300 NVL72: Grace as in GB200 (about 480 GB LPDDR5X per Grace, two GPUs each, four GPUs "
        "per compute tray)",
    ),
    # DGX A100: 2 x EPYC 7742 (64 cores, 8 x DDR4-3200 = 204.8 GB/s each), Gen4 x16 per GPU.
    "a100-80gb": GpuPreset(
        "a100-80gb",
        80.0,
        31.5,
        2 * 204.8 / 8,
        16,
        312.0,
        250.0,
        "A100 SXM 80 GB, PCIe Gen4 host link, 2-socket EPYC Rome node",
        capacity_gib=79.15,
        source="capacity 79.15 GiB: PyTorch OOM messages on A100 80 GB; PCIe Gen4 x16 (31.5 GB/s per direction)",
        nvlink_gbps=300.0,
        network_gbps=25.0,
        link_source=_A100_LINKS,
        host_source="DGX A100 (640 GB) datasheet: 2 TB system memory for 8 GPUs",
    ),
    # DGX B200: 2 x Xeon 8570 (56 cores, 8 x DDR5-5600 = 358 GB/s each), Gen5 x16 per GPU, 180 GB HBM3e.
    "b200": GpuPreset(
        "b200",
        180.0,
        63.0,
        2 * 358.4 / 8,
        14,
        2250.0,
        250.0,
        "B200 180 GB, PCIe Gen5 host link, 2-socket Emerald Rapids node",
        capacity_gib=178.35,
        source=f"capacity 178.35 GiB: PyTorch OOM messages on B200; {_PCIE5}; DGX B200 datasheet (host)",
        fp8_tflops=4500.0,
        nvlink_gbps=900.0,
        link_source=_B200_LINKS,
        host_source="DGX B200 user guide: 2 TB system memory (32 DIMMs, upgradable to 4 TB) for 8 GPUs",
    ),
    # DGX B300: 2 x Xeon 6776P (64 cores, 8 x DDR5-6400 = 410 GB/s each), 2 TB RAM; the CPUs are PCIe Gen5.
    "b300": GpuPreset(
        "b300",
        288.0,
        63.0,
        2 * 409.6 / 8,
        16,
        2250.0,
        250.0,
        "B300 288 GB, PCIe Gen5 host link, 2-socket Granite Rapids node",
        capacity_gib=267.69,
        source=f"capacity 267.69 GiB: PyTorch OOM message on a 2 x 8 B300 system in a public report; {_PCIE5} "
        "(the host CPUs are Gen5 even where the GPU side is Gen6); DGX B300 datasheet (host)",
        fp8_tflops=4500.0,
        nvlink_gbps=900.0,
        network_gbps=100.0,
        link_source=_B300_LINKS,
        host_source="DGX B300: 2 TB system memory for 8 GPUs assumed, as DGX B200 (configurations up to 4 TB "
        "exist: pass --host-ram-gb)",
    ),
}


def gpu_preset(name: str) -> GpuPreset:
    """Look up a GPU preset by name.

    Raises:
        KeyError: with the list of known names, for an unknown preset.
    """
    key = name.strip().lower()
    if key not in GPU_PRESETS:
        raise KeyError(f"unknown GPU preset {name!r}; known: {', '.join(sorted(GPU_PRESETS))}")
    return GPU_PRESETS[key]


def with_overrides(preset: GpuPreset, **values: float | int | None) -> GpuPreset:
    """A copy of ``preset`` with the given (non-None) fields replaced, e.g. ``hbm_gb=48``."""
    given: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
    if "link_gbps" in given:  # a stated link replaces the measured figures of the preset
        given.update(measured_d2h_gbps=None, measured_h2d_gbps=None)
    if "host_ram_gb" in given or "gpus_per_node" in given:
        given["host_source"] = "given (--host-ram-gb per GPU, --gpus-per-node)"
    return replace(preset, **given)


def render_gpu_table() -> str:
    """The GPU presets as a Markdown table with each figure's source (docs/planner.md, section gpu-presets)."""
    lines = [
        "| preset | exposed GiB | D2H / H2D GB/s used | host GB/s per GPU | cores per GPU | host RAM per node "
        "(GPUs) | bf16 / FP8 TFLOP/s | NVLink GB/s per direction (domain) | network GB/s per GPU | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in GPU_PRESETS.values():
        exposed = f"{p.capacity_gib:.2f}" if p.capacity_gib else f"{p.hbm_gb:g} GB (marketed)"
        measured = " (measured)" if p.measured_d2h_gbps or p.measured_h2d_gbps else ""
        fp8 = f"{p.fp8_tflops:g}" if p.fp8_tflops else "—"
        lines.append(
            f"| `{p.name}` | {exposed} | {p.d2h_effective_gbps:.0f} / {p.h2d_effective_gbps:.0f}{measured} "
            f"| {p.host_bw_gbps:.0f} | {p.cpu_cores} | {p.host_ram_node_gb:.0f} GB ({p.gpus_per_node}) "
            f"| {p.peak_tflops:g} / {fp8} | {p.nvlink_gbps:g} ({p.nvlink_domain}) | {p.network_gbps:g} "
            f"| {p.source}; {p.link_source}; host RAM: {p.host_source} |"
        )
    return "\n".join(lines) + "\n"
