"""Replace the generated part of a markdown file (benchmarks/RESULTS.md, the README): the text
between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (shared by the report scripts)."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_path(path):
    """``path`` as the generated notes cite it: from the repository root, wherever the file
    they are written into lives."""
    return os.path.relpath(os.path.abspath(path), REPO)


def write_section(readme_path, name, text):
    with open(readme_path) as f:
        readme = f.read()
    pattern = rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)"
    # a function, not a replacement string: the tables may hold backslashes
    readme, found = re.subn(pattern, lambda m: m.group(1) + text + "\n" + m.group(2), readme,
                            flags=re.S)
    if not found:
        raise SystemExit(f"{readme_path} has no <!-- {name}:begin/end --> markers")
    with open(readme_path, "w") as f:
        f.write(readme)
