"""Only one build step is not declarative (everything else is in pyproject.toml): the wheel ships the
top-level ``conf/`` YAML as ``pipeline/conf`` (package data), where ``pipeline.schema.compose.CONF_DIR`` finds it."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithConf(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads conf/ from the checkout
        dest = Path(self.build_lib) / "pipeline" / "conf"
        for src in sorted((ROOT / "conf").rglob("*.yaml")):
            target = dest / src.relative_to(ROOT / "conf")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


setup(cmdclass={"build_py": BuildPyWithConf})
