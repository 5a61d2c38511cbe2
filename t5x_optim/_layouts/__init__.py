"""The layouts room: ways to run an optax update other than leaf by leaf.

- `fused` (a subpackage): the multi-tensor update that
  ``OptaxWrapper(fused=...)`` runs: the proof that an update is elementwise
  per leaf, the Pallas kernel and its sharding;
- `stacked`: params and optax state kept stacked by shape between steps,
  and the stacked layer that runs a plain definition on them.

Imports only the core room and below. The plain update never enters it: the
wrapper hands over to a layout only when one was asked for.
"""
