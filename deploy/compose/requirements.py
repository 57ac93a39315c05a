"""Print the requirements of millstream's core and EXTRAS (comma list) from pyproject.toml, so
the image installs dependencies in a layer of their own, before the source is copied.

    python3 requirements.py pyproject.toml all
"""

import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras, wanted, seen = project["optional-dependencies"], sys.argv[2].split(","), set()
deps = list(project["dependencies"])
while wanted:
    name = wanted.pop()
    if name in seen:
        continue
    seen.add(name)
    for dep in extras[name]:
        if dep.startswith("millstream["):
            wanted += dep[len("millstream[") : -1].split(",")
        else:
            deps.append(dep)
print("\n".join(deps))
