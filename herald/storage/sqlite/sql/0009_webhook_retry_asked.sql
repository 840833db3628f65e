-- SQLite migration 9: a retry asked for (POST .../retry) while the delivery's attempt is in
-- flight is remembered until that attempt is recorded. Making the delivery due now was not
-- enough: the attempt's own record then set its next attempt, so a failing attempt waited
-- the schedule's delay, the request lost. Its time (NULL: none asked); no index, the finish
-- reads it from the delivery's own row.
ALTER TABLE webhook_deliveries ADD COLUMN retry_asked_at REAL;
