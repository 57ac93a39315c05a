"""The local cluster: what one command starts on this machine besides itself (millstream.launch).

Owns starting, watching and stopping the run's other processes (`cluster`: redis-server,
engines, router, rollout and reward workers), process supervision (`procs`: no child outlives
its parent, a run dir has one owner) and what runs where (`plan`: engines given or started
here, the split of the cores). It is not a service: an entry point (today `millstream train`)
uses it, and it imports only `millstream.common`; the services it starts meet on the wire as
they would anywhere else.
"""
