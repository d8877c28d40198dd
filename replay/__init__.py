"""Replay a registered workflow (a `pyflyte package` archive) node by node, the way a Flyte cluster runs it.

What is registered is what runs: every task starts from its serialised container args in a fresh process,
with the environment and storage layout a Flyte pod gets, and multi-node pytorch tasks start one process
per worker replica of the PyTorchJob that Flyte's kfoperators plugin would create. See ``python -m replay
--help`` and "Replaying a registration locally" in docs/backends.md.

Modules: ``package`` (the archive), ``store`` (object store and propeller's paths), ``literals`` (launch
inputs, bindings, output display), ``pod`` (one container as a process), ``pytorchjob`` (the PyTorchJob
manifest and its worker pods), ``graph`` (the workflow walk, dynamic expansion, aborts and recovery),
``cli``, ``retry`` (one node rerun as a later attempt; single pods restarted from their pod.json).
"""
