"""Llama-family model code and weight loading."""
