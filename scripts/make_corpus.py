"""Build the bundled English corpus (assets/corpus/{train,validation}.jsonl).

Why: tiny-model loss curves only mean something on real language, and the repo
must train offline. Every text here is public domain, taken from Debian packages
so the build is reproducible without any network access beyond Debian's mirror.

Sources (Debian bookworm package -> text, licence of the text):
  r-cran-janeaustenr 1.0.0-1  -> Pride and Prejudice, Persuasion, Northanger Abbey
                                 (Jane Austen, 1811-1818; public domain; package MIT)
  r-cran-tokenizers 0.3.0-1   -> Moby Dick (Herman Melville, 1851; public domain,
                                 Project Gutenberg #2701 with the PG header/licence removed;
                                 package MIT)
  jargon-text 4.4.7-4.1       -> The Jargon File 4.4.7 (Eric S. Raymond et al.;
                                 the document states it is in the public domain)

Regenerate (no R needed; the R data files are read by a small parser below):

    apt-get update
    apt-get download r-cran-janeaustenr r-cran-tokenizers jargon-text
    for f in *.deb; do dpkg-deb -x "$f" /tmp/corpus-src; done
    python scripts/make_corpus.py --root /tmp/corpus-src

or, with the packages installed (`apt-get install r-cran-janeaustenr
r-cran-tokenizers jargon-text`), `python scripts/make_corpus.py` (root defaults to /).
The output is deterministic: same package versions, same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
AUSTEN = "usr/lib/R/site-library/janeaustenr/data/Rdata"
TOKENIZERS = "usr/lib/R/site-library/tokenizers/data/Rdata"
JARGON = "usr/share/doc/jargon-text/jargon.txt.gz"

# Documents are groups of whole paragraphs of at least this many characters
# (a section's last group may be shorter).
MIN_DOC_CHARS = 1500
# Every VALIDATION_EVERY-th document goes to validation: ~5%, spread over all sources.
VALIDATION_EVERY = 20
# The Jargon File lexicon alone is ~1.2 MB; a third of its entries keeps the corpus < 4 MB.
LEXICON_KEEP_EVERY = 3


# ---------------------------------------------------------------------------
# Minimal reader for R's XDR serialisation (the lazy-load .rdx/.rdb data files)
# ---------------------------------------------------------------------------
class _RReader:
    """Decodes the subset of R's serialisation format that data packages use.

    Why: the novels ship as R data; parsing the few object types involved
    (character/numeric vectors, lists, attribute pairlists) avoids needing R.
    """

    _NULLISH = {254, 253, 252, 251, 250, 247, 242, 241}  # NULL, envs, missing arg...

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("only the XDR R serialisation format is supported")
        self.buf, self.pos, self.refs = data, 2, []
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader version
        if version == 3:
            n = self._int()  # length of the native encoding name, which follows
            self.pos += n

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return value

    def read(self) -> Any:
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in self._NULLISH:
            return None
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol: its name is the CHARSXP that follows
            name = self.read()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP
            length = self._int()
            if length == -1:
                return None  # NA_character_
            text = self.buf[self.pos : self.pos + length].decode("utf-8")
            self.pos += length
            return text
        if kind in (2, 239):  # pairlist -> dict (used for attributes)
            if has_attr:
                self.read()
            tag = self.read() if has_tag else None
            out = {tag: self.read()}
            rest = self.read()
            if isinstance(rest, dict):
                out.update(rest)
            return out
        if kind in (16, 19, 20):  # character vector, list, expression
            value: Any = [self.read() for _ in range(self._int())]
        elif kind in (10, 13):  # logical, integer
            n = self._int()
            value = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            n = self._int()
            value = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            self.read()  # names etc.: not needed for the data we extract
        return value


def read_r_lazyload(prefix: Path) -> dict[str, Any]:
    """Return {name: object} from an R lazy-load database (prefix.rdx + prefix.rdb)."""
    index = _RReader(gzip.decompress(prefix.with_suffix(".rdx").read_bytes()))
    # The index is list(variables=<named list of (offset, length)>, references, compressed);
    # re-read it keeping the names, which the generic reader drops.
    index_obj = _read_named_list(index)
    variables = index_obj["variables"]
    blob = prefix.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in variables.items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        # 4-byte big-endian uncompressed size, then a zlib stream (compression type 1).
        out[name] = _RReader(zlib.decompress(chunk[4:])).read()
    return out


def _read_named_list(reader: _RReader) -> dict[str, Any]:
    """Read a named VECSXP, keeping names (recursively for named sub-lists)."""
    flags = reader._int()
    kind, has_attr = flags & 0xFF, bool(flags & (1 << 9))
    if kind != 19:
        raise ValueError("R lazy-load index is not a list")
    n = reader._int()
    items = []
    for _ in range(n):
        save = reader.pos
        sub_flags = struct.unpack_from(">i", reader.buf, save)[0]
        if sub_flags & 0xFF == 19 and sub_flags & (1 << 9):
            items.append(_read_named_list(reader))
        else:
            items.append(reader.read())
    attrs = reader.read() if has_attr else {}
    names = attrs.get("names", []) if isinstance(attrs, dict) else []
    if len(names) != n:
        return dict(enumerate(items))  # type: ignore[arg-type]
    return dict(zip(names, items, strict=True))


# ---------------------------------------------------------------------------
# Cleaning and splitting
# ---------------------------------------------------------------------------
def reflow(paragraph_lines: list[str]) -> str:
    """Join a hard-wrapped paragraph into one line with single spaces."""
    return re.sub(r"\s+", " ", " ".join(paragraph_lines)).strip()


def paragraphs(lines: list[str]) -> list[str]:
    """Split blank-line separated text into reflowed paragraphs."""
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line)
        elif cur:
            out.append(reflow(cur))
            cur = []
    if cur:
        out.append(reflow(cur))
    return out


def group(paras: list[str], min_chars: int = MIN_DOC_CHARS) -> list[str]:
    """Pack consecutive paragraphs into documents of >= min_chars (last may be short)."""
    docs, cur, size = [], [], 0
    for p in paras:
        cur.append(p)
        size += len(p) + 2
        if size >= min_chars:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        # A short tail joins the previous document of the same section when it can.
        if docs and size < min_chars // 3:
            docs[-1] += "\n\n" + "\n\n".join(cur)
        else:
            docs.append("\n\n".join(cur))
    return docs


def split_sections(lines: list[str], heading: re.Pattern[str]) -> list[list[str]]:
    """Split lines at heading lines (the headings themselves are dropped)."""
    sections: list[list[str]] = [[]]
    for line in lines:
        if heading.match(line.strip()):
            sections.append([])
        else:
            sections[-1].append(line)
    return [s for s in sections if any(x.strip() for x in s)]


def novel_docs(lines: list[str], heading: re.Pattern[str], drop: set[str]) -> list[str]:
    """Chapters -> paragraph groups; front matter (before the first heading) is dropped."""
    first = next(i for i, line in enumerate(lines) if heading.match(line.strip()))
    kept = [line for line in lines[first:] if line.strip() not in drop]
    docs = []
    for section in split_sections(kept, heading):
        paras = [re.sub(r"_([^_]+)_", r"\1", p) for p in paragraphs(section)]  # _italics_
        docs.extend(group(paras))
    return docs


AUSTEN_HEADING = re.compile(r"^(VOLUME|Volume|CHAPTER|Chapter)\s+[IVXLC0-9]+\.?$")


def austen_docs(root: Path) -> list[tuple[str, str]]:
    """Three of the six Austen novels (the corpus would exceed 4 MB with all six)."""
    books = read_r_lazyload(root / AUSTEN)
    out = []
    for key in ("prideprejudice", "persuasion", "northangerabbey"):
        lines = [x or "" for x in books[key]]
        if key == "northangerabbey":  # drop the modern edition's editorial note
            lines = lines[: lines.index("A NOTE ON THE TEXT")]
        docs = novel_docs(lines, AUSTEN_HEADING, {"FINIS", "THE END", "Finis"})
        out.extend((key, d) for d in docs)
    return out


def moby_docs(root: Path) -> list[tuple[str, str]]:
    """Moby Dick without the Project Gutenberg header, transcriber notes and licence."""
    (text,) = read_r_lazyload(root / TOKENIZERS)["mobydick"]
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = text.index("ETYMOLOGY.")
    end = text.index("End of Project Gutenberg")
    lines = text[start:end].split("\n")
    heading = re.compile(r"^(CHAPTER \d+\..*|Epilogue|ETYMOLOGY\.|EXTRACTS .*)$")
    return [("mobydick", d) for d in novel_docs(lines, heading, {"THE END"})]


def jargon_docs(root: Path) -> list[tuple[str, str]]:
    """Jargon File: introduction chapters, lexicon entries and appendices A-C."""
    raw = gzip.decompress((root / JARGON).read_bytes()).decode("utf-8")
    lines = [line.rstrip() for line in raw.replace("\u00a0", " ").split("\n")]
    start = lines.index("Chapter 1. Hacker Slang and Hacker Culture")
    end = lines.index("Bibliography")
    box = re.compile(r"[\u2500-\u257f]")  # table drawing: tables do not reflow into prose
    lines = [line for line in lines[start:end] if not box.search(line)]

    # Drop tables of contents: from a "Table of Contents" line up to the next heading/entry.
    kept, in_toc = [], False
    for line in lines:
        if line.strip() == "Table of Contents":
            in_toc = True
            continue
        is_heading = bool(line) and not line.startswith(" ")
        is_entry = line.startswith("   :")
        if in_toc and (is_heading or is_entry):
            in_toc = False
        if in_toc:
            # A TOC ends where real prose starts: a long wrapped line.
            if len(line.strip()) > 60:
                in_toc = False
            else:
                continue
        kept.append(line)

    # The Glossary's own index (one headword per line) precedes the first entry.
    g = kept.index("Glossary")
    first_entry = next(i for i in range(g, len(kept)) if kept[i].startswith("   :"))
    kept = kept[:g] + kept[first_entry:]

    heading = re.compile(r"^\S.*$")  # unindented lines are section headings
    entry = re.compile(r"^   :(.+?):\s*(.*)$")
    sections: list[list[str]] = [[]]
    n_entries, skipping = 0, False
    for line in kept:
        if heading.match(line):
            sections.append([])
            skipping = False
        elif line.strip().startswith("Part ") and line.startswith("      "):
            continue  # centred "Part II. The Jargon Lexicon" banners
        else:
            m = entry.match(line)
            if m:
                # Keep every LEXICON_KEEP_EVERY-th lexicon entry to stay within the size budget.
                skipping = n_entries % LEXICON_KEEP_EVERY != 0
                n_entries += 1
            if not skipping:
                sections[-1].append(f"   {m.group(1)}: {m.group(2)}".rstrip() if m else line)
    docs = []
    for section in sections:
        paras = [re.sub(r"\{([^{}]+)\}", r"\1", p) for p in paragraphs(section)]  # {xref}
        paras = [p for p in paras if p]
        if paras:
            docs.extend(group(paras))
    return [("jargon", d) for d in docs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/"), help="where the packages' files are")
    parser.add_argument("--out", type=Path, default=REPO / "assets" / "corpus")
    args = parser.parse_args()

    docs = austen_docs(args.root) + moby_docs(args.root) + jargon_docs(args.root)
    args.out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, list[int]] = {}
    with (
        open(args.out / "train.jsonl", "w", encoding="utf-8", newline="\n") as train,
        open(args.out / "validation.jsonl", "w", encoding="utf-8", newline="\n") as val,
    ):
        for i, (source, text) in enumerate(docs):
            is_val = i % VALIDATION_EVERY == VALIDATION_EVERY // 2
            (val if is_val else train).write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            c = counts.setdefault(source, [0, 0])
            c[0] += 1
            c[1] += len(text.encode("utf-8"))
    for source, (n, size) in counts.items():
        print(f"{source:18s} {n:5d} docs {size / 1e6:6.2f} MB")
    for name in ("train.jsonl", "validation.jsonl"):
        path = args.out / name
        n = sum(1 for _ in open(path, encoding="utf-8"))
        print(f"{path}: {n} docs, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
