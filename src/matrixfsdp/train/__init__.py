"""The main job: ``python -m matrixfsdp.train`` (a small Qwen3-style decoder on the Python
standard library's source, under ``matrixfsdp.fully_shard``; see ``cli.py`` for the options).

``cli`` parses and starts the ranks, ``job`` is one rank's training loop, ``data`` the byte
corpus, ``plot`` the loss figure.
"""

from .cli import build_parser, config_from_args, main
from .job import DeviceChoice, TrainConfig, TrainError, choose_device

__all__ = ["main", "build_parser", "config_from_args", "TrainConfig", "TrainError", "DeviceChoice",
           "choose_device"]
