"""mkdocs hook: tidy the reStructuredText markup that tfnng's docstrings use in the rendered pages.

mkdocstrings renders the docstrings as Markdown, so Sphinx roles (``:class:`~pkg.X```) would show as
":class:" before the code span (and keep the "~"), and a paragraph ending in the literal-block
marker "::" would keep both colons.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>~?")
_LITERAL_MARKER = re.compile(r"::(?=</p>)")


def on_page_content(html, **kwargs):
    return _LITERAL_MARKER.sub(":", _ROLE.sub("<code>", html))
