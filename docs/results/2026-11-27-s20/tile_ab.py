"""Issue 21: the Triton decode tiles, end to end. Runs one `pagelm bench ...` command in this
process with `tile_config` patched to a variant for decode-sized tiles (the prefill tile is
left as it is); the split launch (split-K decode) and the main launch (decodes of a batch too
large to split) may get different tiles.
Variants (attn_sweep.py's figures chose them):
  default: both 16x32, 4 warps, 3 stages (pagelm today)
  a: main 16x128 w4 s2, split 16x32 w2 s3
  b: main 16x64 w4 s2, split 16x32 w2 s3
  c: main 16x128 w4 s2, split as today
Run: python3 tile_ab.py VARIANT bench latency|throughput ARGS..."""
import sys

import pagelm.backends.triton.paged_attention as pa
from pagelm.cli import main

VARIANTS = {
    "default": (None, None),
    "a": (pa.TileConfig(16, 128, 4, 2), pa.TileConfig(16, 32, 2, 3)),
    "b": (pa.TileConfig(16, 64, 4, 2), pa.TileConfig(16, 32, 2, 3)),
    "c": (pa.TileConfig(16, 128, 4, 2), None),
}

variant = sys.argv[1]
main_tile, split_tile = VARIANTS[variant]
original = pa.tile_config


def patched(group, head_dim, max_query_len, split=False):
    cfg = original(group, head_dim, max_query_len, split=split)
    if cfg.block_m == 16 and cfg.tile_n == 32:  # the decode-sized tile
        choice = split_tile if split else main_tile
        if choice is not None:
            return choice
    return cfg


pa.tile_config = patched
sys.argv = ["pagelm"] + sys.argv[2:]
sys.exit(main())
