"""TFF aggregation factories used by fltff's methods (single-pass, see DESIGN.md)."""
