"""Regenerate docs/configuration.md from the config dataclasses: python scripts/gen_config_docs.py"""

from pathlib import Path

from titanium.config.reference import render_reference

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    out.write_text(render_reference())
    print(f"wrote {out}")
