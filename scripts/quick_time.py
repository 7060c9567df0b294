"""Quick device-side timing of the fused forward on the shapes of docs/design.md §12 (CUDA events, median of 20
after warm-up, 3 rotated input sets, fewer where they do not fit). A development probe; the benchmark of record is `flashdmoe bench`.

Environment knobs:
  QUICK_SHAPES="T/H/I/E/k[/activation],..." shapes to time; "decode" (alone or as an item) = the decode rows
  of issue 15's table.
  QUICK_ACTIVATION=relu  activation of shapes that name none (gelu by default).
  QUICK_VARIANTS=a,b     expert variants to force; "auto" = what the public call picks (printed).
  QUICK_GATE_SPLIT=auto,on,off  split-gate settings to compare (auto by default).
  QUICK_SMALL_EPILOGUE=on,off  the small-tile GEMM1 epilogue settings to compare (on by default).
  QUICK_SAVE_PRE=on      time the training forward instead: the kernel that also saves GEMM1's pre-activations
                         for the backward (what a forward under autograd runs); they join the digest.
  QUICK_SEED=n           seed of each shape's first input set (0 by default; set i takes n + i): two builds timed with the same seed
                         get the same inputs, so their digests show whether they compute the same bits.
Each row prints the graph-free event time, the kernel time from the profiler, the kernel's phase split and
the weight-bytes floor (the distinct experts' weights expected hit, at 4.3 TB/s), then a "digest" line: a
hash of the output and routing of the first input set.
"""

import hashlib
import os
import statistics

import torch

import flashdmoe
from flashdmoe import cuda_backend
from flashdmoe.bench.results import BenchShape
from flashdmoe.bench.workload import input_set_bytes, make_inputs, sets_that_fit
from flashdmoe.kernel import extension
from flashdmoe.kernel.expert_variants import EXPERT_VARIANTS, choose_variant, variant_id

SHAPES = [(8192, 2048, 2048, 32, 2), (16384, 2048, 2048, 64, 2), (16384, 4096, 1024, 128, 2),
          (4096, 2048, 2048, 64, 2), (128, 4096, 1408, 64, 6)]
DECODE_SHAPES = [(1, 2048, 768, 128, 8, "swiglu"), (2, 2048, 768, 128, 8, "swiglu"), (8, 2048, 768, 128, 8, "swiglu"),
                 (32, 2048, 768, 128, 8, "swiglu"), (128, 4096, 1408, 64, 6, "swiglu"),
                 (128, 4096, 1408, 64, 6, "gelu"), (32, 7168, 2048, 256, 8, "swiglu"),
                 (1, 4096, 14336, 8, 2, "swiglu")]
GATE_SPLIT = {"auto": None, "on": True, "off": False}


def parse_shapes(text: str, activation: str):
    shapes = []
    for item in (s for s in text.split(",") if s):
        if item == "decode":
            shapes.extend(DECODE_SHAPES)
            continue
        fields = item.split("/")
        shapes.append(tuple(int(v) for v in fields[:5]) + (fields[5] if len(fields) > 5 else activation,))
    return shapes


def bytes_floor_ms(T, H, I, E, k, activation):
    hit = E * (1 - (1 - k / E) ** T)
    w1_cols = 2 * I if activation == "swiglu" else I
    return hit * (H * w1_cols + I * H) * 2 / 4.3e12 * 1e3


def main():
    ext = extension.load()
    for name, code in EXPERT_VARIANTS.items():
        print(f"kernel attributes bf16 {name}:", ext.kernel_attributes(0, code))
    print(f"{'variant':>16} {'T':>6} {'H':>5} {'I':>5} {'E':>4} {'k':>2} {'ms':>8} {'TF/s':>7}")
    wanted = [v for v in os.environ.get("QUICK_VARIANTS", "").split(",") if v] or list(EXPERT_VARIANTS)
    for name in wanted:
        if name != "auto":
            variant_id(name)  # an unknown name fails here, before any timing
    splits = [v for v in os.environ.get("QUICK_GATE_SPLIT", "auto").split(",") if v]
    for name in splits:
        if name not in GATE_SPLIT:
            raise ValueError(f"QUICK_GATE_SPLIT={name!r}: expected a list of {sorted(GATE_SPLIT)}")
    small = [v for v in os.environ.get("QUICK_SMALL_EPILOGUE", "on").split(",") if v]
    if not set(small) <= {"on", "off"}:
        raise ValueError(f"QUICK_SMALL_EPILOGUE={small!r}: expected a list of on / off")
    # QUICK_ACTIVATION=relu: how much of a tile's time the GEMM1 epilogue's activation takes.
    activation = os.environ.get("QUICK_ACTIVATION", "gelu")
    # QUICK_SHAPES="T/H/I/E/k,...": shapes besides docs/design.md §12's (e.g. to separate per-tile from per-slab cost).
    shapes = parse_shapes(os.environ.get("QUICK_SHAPES", ""), activation) or [s + (activation,) for s in SHAPES]
    seed = int(os.environ.get("QUICK_SEED", "0"))
    for T, H, I, E, k, activation in shapes:
        # the bench's inputs (drawn in bf16), 3 rotated sets or as many as fit in 60% of the free memory
        # (DeepSeek-V3's layer is 22.5 GB of weights a set)
        shape = BenchShape(T, H, I, E, k)
        free, _ = torch.cuda.mem_get_info()
        count = min(3, sets_that_fit(input_set_bytes(shape, activation, 2), 0, int(0.6 * free)))
        sets = []
        for i in range(count):
            made = make_inputs(shape, activation=activation, dtype=torch.bfloat16, device="cuda", seed=seed + i)
            sets.append((made.x, made.router_weight, made.w1, made.w2))
        print(f"{T}/{H}/{I}/{E}/{k}: {len(sets)} input set(s)")
        for variant in wanted:
            for split in splits:
                for setting in small:
                    cuda_backend.debug.small_tile_epilogue = setting == "on"
                    time_one(sets, T, H, I, E, k, activation, variant, split)
        del sets  # before the next shape's inputs (DeepSeek-V3's are 22 GB a set)
        torch.cuda.empty_cache()


def time_one(sets, T, H, I, E, k, activation, variant, split):
    cols = 2 * I if activation == "swiglu" else I
    cuda_backend.debug.expert_variant = None if variant == "auto" else variant
    cuda_backend.debug.gate_split = GATE_SPLIT[split]
    if variant == "auto":
        blocks = torch.cuda.get_device_properties(0).multi_processor_count
        variant = f"auto:{choose_variant(T, H, I, E, k, activation, blocks)}"
    saving = os.environ.get("QUICK_SAVE_PRE", "off") == "on"
    saved = torch.empty(T * k, cols, dtype=torch.bfloat16, device="cuda") if saving else None
    run = lambda s: cuda_backend.fused_forward(*s, top_k=k, activation=activation, normalize_topk=True,
                                               capacity_factor=None, saved_pre=saved)
    # Events around each forward, no synchronisation in between (a forward never waits): the host runs
    # ahead, so "ms" is the GPU's time per forward (memset + kernel + status copy), not the host's too.
    for i in range(5):
        run(sets[i % len(sets)])
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(21)]
    for i, (a, b) in enumerate(events):
        a.record()
        run(sets[i % len(sets)])
        b.record()
    flashdmoe.synchronize()
    times = [a.elapsed_time(b) for a, b in events]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(6):
            run(sets[i % len(sets)])
        torch.cuda.synchronize()
    flashdmoe.synchronize()
    kern = [e.device_time for e in prof.events() if "moe_forward_kernel" in e.name]
    kernel_ms = statistics.median(kern) / 1000 if kern else float("nan")
    import time as _t

    h0 = _t.perf_counter()
    for i in range(10):
        run(sets[i % len(sets)])
    h1 = _t.perf_counter()
    flashdmoe.synchronize()
    host_us = (h1 - h0) / 10 * 1e6
    ms = statistics.median(times)
    flops = 2 * T * k * H * (cols + I) + 2 * T * H * E
    phases = " ".join(f"{k}={v:.3f}" for k, v in (flashdmoe.last_report().phase_ms or {}).items())
    if os.environ.get("QUICK_PROFILE") == str(T):  # where the host time of a call goes (QUICK_PROFILE=T)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(20):
            run(sets[i % len(sets)])
        profiler.disable()
        flashdmoe.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    if saving:
        saved.fill_(0)  # rows past the kept ones are never written: the digest sees only what the kernel wrote
    y, routing = run(sets[0])
    flashdmoe.synchronize()
    digest = hashlib.sha256()
    for tensor in (y, routing.expert, routing.weight, routing.row) + ((saved,) if saving else ()):
        digest.update(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    print(f"digest {variant} {T}/{H}/{I}/{E}/{k}/{activation}{' saving' if saving else ''} gate_split={split} "
          f"small_epilogue={cuda_backend.debug.small_tile_epilogue}: {digest.hexdigest()[:16]}")
    print(f"{variant:>16} {T:>6} {H:>5} {I:>5} {E:>4} {k:>2} {ms:>8.3f} {flops / ms / 1e9:>7.1f}  kernel {kernel_ms:.3f} ms"
          f" ({flops / kernel_ms / 1e9:.0f} TF/s)  host {host_us:.0f} us/call  phases(ms) {phases}"
          f"  {activation}{' saving' if saving else ''} gate_split={split} small_epilogue={cuda_backend.debug.small_tile_epilogue}"
          f" floor {bytes_floor_ms(T, H, I, E, k, activation):.3f} ms")


if __name__ == "__main__":
    main()
