"""The dataset card (`README.md`) written beside an export: YAML `configs`/`data_files` that
`datasets.load_dataset(DIR)` reads (offline: the files are local), then what each column is and where the rows
come from (run, iterations, the partition's mode, γ or τ and similarity measure, the policy versions that sampled
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml


@dataclass
class Card:
    title: str
    format: str
    summary: str  # what the rows are, one paragraph
    data_files: dict[str, str]  # config name -> glob under the export folder ({} for a format `datasets` cannot read)
    columns: dict[str, str]  # column -> what it is
    provenance: dict[str, str] = field(default_factory=dict)  # e.g. run, iterations, partition, policy versions
    token_exact: bool | str | None = True  # None: no tokens (a prompts file); a text: not exact, and why
    notes: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=lambda: ["cleaner", "agentic-rl", "tool-use"])

    def render(self) -> str:
        header: dict = {"tags": self.tags}
        if self.data_files:
            header["configs"] = [
                {
                    "config_name": name,
                    "data_files": [{"split": "train", "path": glob}],
                    **({"default": True} if n == 0 else {}),
                }
                for n, (name, glob) in enumerate(self.data_files.items())
            ]
        lines = [
            "---",
            yaml.safe_dump(header, sort_keys=False, allow_unicode=True).rstrip(),
            "---",
            "",
            f"# {self.title}",
            "",
            self.summary,
            "",
            f"Format: `{self.format}`. Token-exact: "
            + (
                "n/a (prompts: the trainer samples its own rollouts)."
                if self.token_exact is None
                else "yes (the token ids the policy sampled and trains on)."
                if self.token_exact is True
                else self.token_exact
                if isinstance(self.token_exact, str)
                else "no (text: a consumer re-tokenizes it)."
            ),
            "",
        ]
        if self.provenance:
            lines += ["## Where the rows come from", "", "| | |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in self.provenance.items()] + [""]
        if self.columns:
            lines += ["## Columns", "", "| column | what it is |", "|---|---|"]
            lines += [f"| `{k}` | {v} |" for k, v in self.columns.items()] + [""]
        if self.data_files:
            lines += [
                "## Loading",
                "",
                "```python",
                "from datasets import load_dataset",
                "",
                'rows = load_dataset("path/to/this/folder", split="train")  # works offline',
                "```",
                "",
            ]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        lines.append("Written by `cleaner export` (docs/formats.md says what each format keeps and loses).")
        return "\n".join(lines) + "\n"
