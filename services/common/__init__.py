"""What every service shares and nothing else: the config and its flag checks (`config/`), the
wire types (`types`, `pb/`), Redis keys and streams, the one worker shape, telemetry, HTTP and
Redis connections. Miles' stand-ins and the plugin loader are `compat/`'s, the command-line
tools `tools/`'s; it imports neither, no service, and no torch at import time.
"""
