"""The checkpoint room: saving and restoring train states, ours and T5X's.

- `storage`: every path, local or on an object store (epath files,
  tensorstore kvstores by scheme);
- `leaves`: stored arrays checked against the expected leaves;
- `headers`: array headers read without the data; `checksums`: per-array
  checksums; `lock` and `lease`: one writer per directory;
- `store`: the orbax-backed checkpoint store;
- `t5x_read` and `t5x_write`: T5X's own format;
- `converting`: a restore into a train state with another optimizer;
- `api`: the public `Checkpointer` and `restore_t5x_checkpoint`, which send
  ``convert_from=`` to `converting` and everything else to the store or the
  T5X reader.

Imports the training, conversion, core and lower rooms.
"""
