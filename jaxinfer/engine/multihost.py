"""Several hosts: one process per host (``jax.distributed``), process 0 schedules, every process runs
the same programs.

Every process loads its devices' slices of the weights and compiles the same programs at start-up.
Then process 0 (the leader) runs the engine as on one host; before each device call (a program of
the grid, or the cache allocation) it sends every other process (the followers) what to run: the
program's ``CompileKey`` and its step inputs, through the key-value store of jax's distributed
runtime (no program is compiled for it, so strict mode holds). A follower (``LLM.follow()``) makes
each call it receives, in order, until the leader sends ``STOP`` (``LLM.shutdown()``, or its process
exiting). The programs' collectives then run across the hosts.
"""

from __future__ import annotations

import io
import os

import jax
import numpy as np

from jaxinfer.engine.aot import CompileKey
from jaxinfer.errors import ConfigError

STOP, PROGRAM, ALLOCATE = "stop", "program", "allocate"
_PREFIX = "jaxinfer/calls"
_WAIT_MS = 60_000  # a follower waits this long per poll for its next call, then polls again


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` when several processes are asked for, by these arguments or by
    jax's environment variables (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``);
    nothing for a single process. Call it before anything touches a device."""
    given = (coordinator_address, num_processes, process_id)
    from_env = tuple(os.environ.get(name) for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                      "JAX_PROCESS_ID"))
    if all(value is None for value in given + from_env):
        return
    coordinator_address = coordinator_address or from_env[0]
    try:
        num_processes = int(num_processes if num_processes is not None else from_env[1])
        process_id = int(process_id if process_id is not None else from_env[2])
    except (TypeError, ValueError):
        raise ConfigError("several processes need all three of coordinator_address (HOST:PORT), num_processes and "
                          "process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)") from None
    if not coordinator_address or num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"coordinator_address={coordinator_address!r}, num_processes={num_processes}, "
                          f"process_id={process_id}: give HOST:PORT, a positive count and an id in [0, count)")
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def is_leader() -> bool:
    return jax.process_index() == 0


def _client():
    # The distributed runtime's key-value store (the coordination service every process is connected to).
    from jax._src import distributed

    return distributed.global_state.client


def _encode(what: str, key: CompileKey | None, leaves: list) -> bytes:
    header = np.array([what, *(() if key is None else (key.kind, key.num_tokens, key.num_seqs, key.pages_per_seq))])
    buffer = io.BytesIO()
    np.savez(buffer, header=header, **{f"leaf{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
    return buffer.getvalue()


def _decode(data: bytes) -> tuple[str, CompileKey | None, list]:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        header = [str(x) for x in arrays["header"]]
        count = len(arrays.files) - 1
        leaves = [arrays[f"leaf{i}"] for i in range(count)]
    key = None if len(header) == 1 else CompileKey(header[1], *(int(x) for x in header[2:]))
    return header[0], key, leaves


class Leader:
    """Process 0's side: numbers its calls and posts each one for every follower."""

    def __init__(self):
        self.sent = 0

    def send(self, what: str, key: CompileKey | None = None, inputs=None) -> None:
        if jax.process_count() == 1:
            return
        data = _encode(what, key, jax.tree.leaves(inputs) if inputs is not None else [])
        client = _client()
        for process in range(1, jax.process_count()):
            client.key_value_set_bytes(f"{_PREFIX}/{process}/{self.sent}", data)
        self.sent += 1


def follow(runner) -> int:
    """A follower's loop: make every call the leader posts, in order, until ``STOP``; -> calls made."""
    client, me, made = _client(), jax.process_index(), 0
    while True:
        name = f"{_PREFIX}/{me}/{made}"
        try:
            data = client.blocking_key_value_get_bytes(name, _WAIT_MS)
        except Exception as e:  # the runtime reports a timeout as an error: poll again
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue
            raise
        client.key_value_delete(name)
        what, key, leaves = _decode(data)
        made += 1
        if what == STOP:
            return made
        if what == ALLOCATE:
            runner.allocate_caches()
        else:
            template = runner.example_inputs(key)
            runner.call(key, jax.tree.unflatten(jax.tree.structure(template), leaves))
