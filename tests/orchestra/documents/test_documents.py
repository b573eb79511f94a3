"""Documents in other formats, made in the tests with real writers: PDF (fpdf2, pypdf), HTML, DOCX (python-docx)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from orchestra.documents.formats import load_document, sniff_kind
from orchestra.errors import DocumentFormatError, InputFileError
from orchestra.family.corpus import data_text
from tests.cli_run import run_pipeline_text

LICENCE = data_text("mpl-2.0.txt")


def _pdf(pages: list[str], *, encrypt: str | None = None) -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=10)
    for text in pages:
        pdf.add_page()
        if text:
            pdf.multi_cell(0, 5, text.encode("latin-1", "replace").decode("latin-1"))
    data = bytes(pdf.output())
    if encrypt is None:
        return data
    import pypdf

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=encrypt, owner_password=encrypt + "-owner")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_pdf_is_read_page_by_page_with_page_anchors_and_empty_pages_skipped(tmp_path):
    pages = [LICENCE[:1500], "", LICENCE[1500:3000]]
    path = tmp_path / "licence.pdf"
    path.write_bytes(_pdf(pages))
    doc = load_document(path)
    assert doc.kind == "pdf" and doc.pages == 3
    assert [a.label for a in doc.anchors] == ["[page 1]", "[page 3]"]  # page 2 is empty: nothing to cite
    assert doc.text.startswith("[page 1]\n") and "Mozilla Public License" in doc.text
    third = doc.text.index("[page 3]")
    assert doc.anchor_at(third + 10).label == "[page 3]" and doc.anchor_at(5).label == "[page 1]"
    words = LICENCE[1600:1700].split()[2:8]
    assert " ".join(words) in " ".join(doc.text[third:].split())  # the text itself, not just markers


def test_an_encrypted_scanned_or_damaged_pdf_says_what_to_do(tmp_path):
    with pytest.raises(DocumentFormatError, match="encrypted PDF: decrypt it first"):
        load_document(_pdf([LICENCE[:500]], encrypt="secret"))
    assert "Mozilla" in load_document(_pdf([LICENCE[:500]], encrypt="")).text  # an empty user password opens
    with pytest.raises(DocumentFormatError, match="no text layer .* run OCR"):
        load_document(_pdf(["", ""]))
    data = _pdf([LICENCE[:2000]])
    with pytest.raises(DocumentFormatError, match="not a readable PDF"):
        load_document(data[: len(data) // 3])


HTML = """<!DOCTYPE html><html><head><meta charset="{charset}"><title>Licence</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About us</a> | <a href="/shop">Shop</a></nav>
<header><p>Subscribe to our newsletter for weekly updates!</p></header>
<article><h1>The licence</h1><p>{p1}</p><h2>Termination</h2><p>{p2}</p>
<table><tr><th>Term</th><th>Months</th></tr><tr><td>Notice</td><td>3</td></tr></table></article>
<footer><p>Copyright 2026 Example Corp. All rights reserved. Privacy policy. Cookie settings.</p></footer>
</body></html>"""


def test_html_keeps_the_article_and_its_headings_and_drops_the_boilerplate(tmp_path):
    p1, p2 = LICENCE[200:900].replace("\n", " "), LICENCE[900:1500].replace("\n", " ")
    path = tmp_path / "page.html"
    path.write_text(HTML.format(charset="utf-8", p1=p1, p2=p2), encoding="utf-8")
    doc = load_document(path)
    assert doc.kind == "html" and "Termination" in [a.label.lstrip("# ") for a in doc.anchors]
    assert " ".join(p2.split()[:6]) in " ".join(doc.text.split())
    assert "newsletter" not in doc.text and "Cookie settings" not in doc.text and "About us" not in doc.text
    assert "Notice" in doc.text  # the table's text is kept


def test_html_in_another_declared_encoding_is_decoded_by_its_charset(tmp_path):
    text = "Le concédant garantit que la licence est libre et gratuite, sans frais ni redevance. " * 6
    raw = HTML.format(charset="iso-8859-1", p1=text, p2=text).encode("latin-1")
    doc = load_document(raw, name="page.html")
    assert "concédant" in doc.text and "\ufffd" not in doc.text


def test_a_docx_keeps_headings_paragraphs_and_tables(tmp_path):
    import docx

    document = docx.Document()
    document.add_heading("Obligations", level=1)
    document.add_paragraph(LICENCE[300:800])
    document.add_heading("Termination", level=2)
    document.add_paragraph(LICENCE[800:1200])
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text, table.cell(0, 1).text, table.cell(1, 0).text, table.cell(1, 1).text = "Term", "Days", \
        "Notice", "30"
    path = tmp_path / "contract.docx"
    document.save(path)
    doc = load_document(path)
    assert doc.kind == "docx" and [a.label for a in doc.anchors] == ["# Obligations", "## Termination"]
    assert "Notice | 30" in doc.text
    with pytest.raises(DocumentFormatError, match="not a readable DOCX"):
        load_document(path.read_bytes()[:400], kind="docx")


def test_text_and_markdown_and_the_format_sniffing():
    assert sniff_kind(b"%PDF-1.7 ...") == "pdf" and sniff_kind(b"<!doctype html><p>x") == "html"
    assert sniff_kind(b"plain words", "notes.md") == "markdown" and sniff_kind(b"plain words") == "text"
    md = load_document("# Title\n\nSome text.\n\n## Part two\n\nMore.")
    assert md.kind == "markdown" and [a.label for a in md.anchors] == ["# Title", "## Part two"]
    with pytest.raises(InputFileError, match="binary file"):
        load_document(Path("/bin/ls") if Path("/bin/ls").is_file() else b"\x00\x01\x02" * 100)
    with pytest.raises(InputFileError, match="--encoding"):
        load_document("caf\xe9 au lait".encode("latin-1"), name="notes.txt")


def test_orchestra_run_reads_a_pdf_document_and_refuses_an_encrypted_one_in_one_line(fam, mapstore, tmp_path):
    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "agents:\n  - {name: a, model: base, spec: {task: 'Answer: who may copy it?', "
            "generation: {max_new_tokens: 3}}}\n")
    pdf = tmp_path / "doc.pdf"
    pdf.write_bytes(_pdf([LICENCE[:150], LICENCE[150:300]]))
    code, _, out = run_pipeline_text(tmp_path, yaml, "", "--document", str(pdf), "--report", str(tmp_path / "r.json"))
    assert code == 0, out
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["document_tokens"] > 100  # the PDF's text, not the empty doc.txt the helper wrote
    locked = tmp_path / "locked.pdf"
    locked.write_bytes(_pdf([LICENCE[:300]], encrypt="pw"))
    code, lines, out = run_pipeline_text(tmp_path, yaml, "", "--document", str(locked))
    assert code == 2 and len(lines) == 1 and "encrypted PDF" in lines[0], out
