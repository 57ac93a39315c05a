"""What every service shares and nothing else: the config and its flag checks (`config/`), the
wire types (`types`, `pb/`), Redis keys and streams, the one worker shape, telemetry, plugin
loading and Miles' stand-ins. It imports no service and no torch at import time.
"""
