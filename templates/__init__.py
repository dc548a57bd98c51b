"""Jinja2 kernel templates and the CUDA headers they include (installed as ``cuflash.templates``)."""
