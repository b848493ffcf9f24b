"""The artifact format both sides read (torch-free): today the tokenizer; the manifest sits in export/."""
