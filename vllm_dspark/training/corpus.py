"""Offline training text: the running Python's standard library and pydoc topics.

Every machine with the project's Python has both, so the tiny models can be
rebuilt without any download. The held-out split is by document (a crc32 of
its name), so it does not depend on which other files exist.
"""

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# Test suites are large, repetitive and full of odd literals; site-packages is
# whatever happens to be installed, which would break reproducibility.
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
_MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class Document:
    name: str  # "code:<relative path>" or "prose:<topic>"
    text: str

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[0]


def code_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(f"code:{rel.as_posix()}", text))
    return docs


def prose_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"prose:{key}", topics[key]) for key in sorted(topics)]


def is_heldout(doc: Document, every: int = 20) -> bool:
    return zlib.crc32(doc.name.encode()) % every == 0


def split_corpus(every: int = 20) -> tuple[list[Document], list[Document]]:
    """(train, heldout) over code and prose documents, deterministic."""
    docs = code_documents() + prose_documents()
    train = [d for d in docs if not is_heldout(d, every)]
    heldout = [d for d in docs if is_heldout(d, every)]
    return train, heldout
