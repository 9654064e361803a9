"""Offline text corpora: real English prose that every machine has without a download."""
