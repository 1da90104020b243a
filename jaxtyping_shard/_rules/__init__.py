"""Logical axis rules: the table (`table`) and which one is in force (`scope`)."""
