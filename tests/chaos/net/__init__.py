"""`make chaos-net`: network partitions as silence. netns.py makes the namespaces and the
partitions, deployment.py runs every service in its own, scenarios.py injects and checks."""
