"""Two processes on the CPU (gloo), as accelerate's ``debug_launcher`` sets them up (DDP; FSDP2 with
:func:`allow_fsdp_on_cpu`)."""

import os

import torch


def reset_accelerate_state():
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def launch_two(run, *args, **kwargs):
    """``run(*args, **kwargs)`` in 2 processes with the environment of accelerate's ``debug_launcher``, but spawning:
    forking a process whose OpenMP pool already ran (any earlier test) can deadlock the children. ``run`` must be a
    module-level function (it is pickled)."""
    import socket
    import tempfile

    from accelerate.utils import PrepareForLaunch, patch_environment
    from torch.multiprocessing import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        tempfile.TemporaryDirectory() as rdv,
        patch_environment(
            world_size=2,
            master_addr="127.0.0.1",
            master_port=str(port),
            accelerate_mixed_precision="no",
            accelerate_debug_rdv_file=os.path.join(rdv, "rdv"),
            accelerate_use_cpu="yes",
            gloo_socket_ifname="lo",
        ),
    ):
        start_processes(PrepareForLaunch(_Job(run, args, kwargs), debug=True), nprocs=2, start_method="spawn")


class _Job:
    def __init__(self, run, args, kwargs):
        self.run, self.args, self.kwargs = run, args, kwargs

    def __call__(self):
        self.run(*self.args, **self.kwargs)
        # Tear gloo down before the interpreter exits: a live process group's threads otherwise end in
        # "terminate called without an active exception" (SIGABRT) on some exits (seen about 1 run in 6).
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def allow_fsdp_on_cpu():
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_hf_dp_patched", False):
        return

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # what accelerate does for the GPU device types
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    init._hf_dp_patched = True
    AcceleratorState.__init__ = init


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (all-gathered from the shards: every process must call it)."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out
