"""Print the commands of the README's Quickstart code block, one per line (for .ci/run)."""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text()
section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
block = section and re.search(r"^```(?:bash|sh)\n(.*?)^```", section.group(1), re.S | re.M)
if not block:
    sys.exit("README.md has no ```bash block under '## Quickstart'")
for line in block.group(1).splitlines():
    if line.strip() and not line.lstrip().startswith("#"):
        print(line.strip())
