"""Migration operations Django has no form for."""

from django.db import migrations


def drop_plain_index(table: str, column: str) -> migrations.RunSQL:
    """Drop the plain index of a foreign key's column (whatever name Django hashed for it),
    leaving the unique or partial indexes on that column; reversed, it is made again."""
    return migrations.RunSQL(
        f"""
        DO $$
        DECLARE name text;
        BEGIN
            FOR name IN SELECT i.indexrelid::regclass::text FROM pg_index i
                        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                        WHERE i.indrelid = '{table}'::regclass AND a.attname = '{column}'
                          AND i.indnatts = 1 AND NOT i.indisunique AND i.indpred IS NULL
            LOOP
                EXECUTE 'DROP INDEX ' || name;
            END LOOP;
        END $$;
        """,
        reverse_sql=f'CREATE INDEX "{table}_{column}_fk" ON {table} ({column})',
    )
