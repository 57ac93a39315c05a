"""A stand-in for the `sglang` package, for tests only: a test puts tests/support/sglang_standin
on PYTHONPATH, so `millstream train` finds "SGLang installed" and starts
`python -m sglang.launch_server ...` exactly as it would start the real server; this package's
launch_server has the real SGLang (.venv/sglang, in a child process) parse and resolve the
command line, then runs millstream's engine with the settings SGLang parsed. So the command
line, SGLang's verdict on it, the registration with the router, the health wait and the weight
sync go through the code a real SGLang server gets. Never installed, never imported by
millstream itself."""
