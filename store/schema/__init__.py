"""The schema: tables declared once, what each column can store, the documented views' names,
and upgrading or checking a database's revision. Import from the modules below."""
