"""Miles compatibility, for the services that run users' code (trainer, rollout and reward
workers): Miles' modules stood in for (`miles/`: a plugin written for Miles imports them as
`miles.*`, through the import hook of `miles/importer.py`) and the loader of every function a
--*-path flag names (`plugins.py`), which installs that hook first. It imports only `common`.
"""
