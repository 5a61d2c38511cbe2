"""The low-precision room: optimizer states stored in fewer bits between steps.

- `quantize`: the block-wise 8-bit codec, stochastic rounding to bfloat16;
- `quantize4`: the 4-bit codec (two values per byte, block-wise and rank-1 scales);
- `low_precision`: any optax optimizer's param-shaped state stored in
  bfloat16, 8 or 4 bits, updated leaf by leaf.

Imports the fused update's elementwise analysis (`t5x_optim._layouts`) and
the core room.
"""
