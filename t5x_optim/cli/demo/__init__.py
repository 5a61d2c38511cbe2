"""The demo model and data that ``t5x-optim train`` runs when a config names no other.

- `model`: a decoder-only transformer LM (`TransformerLM`) and a synthetic
  copy task (`SyntheticTask`);
- `text`: a byte-level text task (`TextTask`) read from a file or folder,
  local or on an object store.
"""
