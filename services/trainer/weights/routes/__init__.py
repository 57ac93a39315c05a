"""The weight routes, trainer rank 0's side: one interface (`base.Sender`: what a route sends,
`Push`: what it needs from the sync), one module per route, and the choice among them.

    base.py           buckets (what every route sends), Route, Push, Sender
    choose.py         the route per engine (`auto` picks by where both live and says why;
                      nccl, tensor, disk force one) and the senders (the one factory)
    nccl.py           the update group (NCCL, or gloo with a side on a CPU), kept between syncs;
                      process_group.py: rank 0's torch process group
    tensor.py         /update_weights_from_tensor with millstream's handle: CUDA IPC, shared memory
    sglang_format.py  the same to an SGLang server, in SGLang's format; SGLang's update session
    disk.py           safetensors files and /update_weights_from_disk

The routes' names, from --update-weight-transport to what an engine advertises, are one table:
common/weight_routes.py (the config parses and checks the flag there, once).
"""
