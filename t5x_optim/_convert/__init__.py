"""The conversion room: an optimizer's state carried into another optimizer.

- `registry`: converters keyed by state type, and the helpers they share;
- `builtin`: the built-in converters and their formulas;
- `convert`: `convert_state`, the per-parameter walk and its report,
  decoding and encoding low-precision states on the way.

Imports the low-precision, core and lower rooms.
"""
