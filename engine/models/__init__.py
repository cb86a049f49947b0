"""Model families, written against the op table."""
