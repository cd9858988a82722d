"""Integrations with outside frameworks: torchtitan (``titan``) and Hugging Face transformers
(``huggingface``). The runtimes import nothing from here."""
