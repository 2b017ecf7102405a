-- Budget periods on Redis's clock, in UTC days (unix time // 86400): which days a period spans
-- and when it resets (spent.lua; count_spend.lua writes the days).
local ROLLING_DAYS = {day = 1, week = 7, month = 30}

local function year_month(days)  -- a unix day's civil year and month (H. Hinnant's civil_from_days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function first_of_month(y, m)  -- the unix day of y-m-01 (days_from_civil)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + math.floor((153 * mp + 2) / 5)
  return era * 146097 + doe - 719468
end

-- The first day a period counts (today is its last) and the unix second it resets: a calendar
-- period at its next start, a rolling one when its oldest day leaves it (at midnight UTC).
local function period_window(today, period, rolling)
  if rolling then return today - ROLLING_DAYS[period] + 1, (today + 1) * 86400 end
  if period == 'day' then return today, (today + 1) * 86400 end
  if period == 'week' then  -- ISO weeks: from Monday (day 0, 1970-01-01, was a Thursday)
    local monday = today - (today + 3) % 7
    return monday, (monday + 7) * 86400
  end
  local y, m = year_month(today)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return first_of_month(y, m), first_of_month(ny, nm) * 86400
end
