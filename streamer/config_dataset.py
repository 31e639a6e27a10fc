"""The ``[dataset]`` section: training rows from several sources mixed by weight, and where
the Arrow conversions of files and hub datasets are kept.

With no ``[[dataset.sources]]`` the producers read ``producer.dataset``. With some, the
sources replace it, and ``producer.dataset`` must be left at its default (checked by
:class:`~streamer.config.RunConfig`). A source's ``path`` is anything ``producer.dataset``
takes; its ``weight`` is the share of the tickets its rows get (producers/mix.py).
"""

from __future__ import annotations

from typing import NamedTuple

from streamer.config_base import PosFloat, Section

HUB = "hf:"  # a hub dataset: hf:owner/name, or hf:owner/name/config, either with :split


class HubName(NamedTuple):
    repo: str  # owner/name
    config: str  # "" = the dataset's default
    split: str  # "" = the split the caller asks for


def hub_name(path: str) -> HubName:
    """``hf:owner/name[/config][:split]`` in its parts; a ValueError says the form."""
    body, _, split = path.removeprefix(HUB).partition(":")
    parts = body.split("/")
    if len(parts) not in (2, 3) or not all(parts) or ":" in split:
        raise ValueError(f"{path!r} is not hf:owner/name, hf:owner/name/config or either with :split")
    return HubName("/".join(parts[:2]), parts[2] if len(parts) == 3 else "", split)


class SourceSection(Section):
    """One source of training rows, ``[[dataset.sources]]``."""

    path: str = ""  # required: a JSONL, parquet or Arrow file, a directory of them, "demo", or hf:owner/name
    weight: PosFloat = 1.0  # its share of the tickets: weight / the sum of the sources' weights
    split: str = ""  # a hub dataset's split ("" = train) or the demo's (train / eval)
    name: str = ""  # a hub dataset's configuration ("" = its default)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("`path` is required: a file, a directory, demo, or hf:owner/name")
        demo = self.path.split(":")[0] == "demo"
        if not self.path.startswith(HUB):
            if self.name:
                raise ValueError("`name` is a hub dataset's configuration: the path must be hf:owner/name")
            if self.split and not demo:
                raise ValueError("`split` chooses a split of a hub dataset (hf:owner/name) or of demo")
            return
        try:
            hub = hub_name(self.path)
        except ValueError as e:
            raise ValueError(f"`path` {e}") from None
        if (self.split and hub.split) or (self.name and hub.config):
            raise ValueError(f"`path` {self.path!r} names its split or configuration already")

    @property
    def dataset(self) -> str:
        """The source as ``producer.dataset`` names one: a hub configuration joins the path."""
        if not self.name:
            return self.path
        hub = hub_name(self.path)
        return f"{HUB}{hub.repo}/{self.name}" + (f":{hub.split}" if hub.split else "")


class DatasetSection(Section):
    sources: list[SourceSection] = []  # rows mixed by weight, [[dataset.sources]]; replaces producer.dataset
    cache_dir: str = ""  # Arrow conversions of files and hub datasets; "" = {run.data_dir}/datasets
