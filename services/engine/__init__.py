"""The CPU/dev inference engine: speaks SGLang's HTTP API so it and real SGLang are interchangeable."""
